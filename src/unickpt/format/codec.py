"""Metadata codec: ``Metadata`` <-> UTF-8 JSON bytes, with version dispatch and validation.

Writers call ``encode_metadata`` once (the coordinator, at commit). Readers call
``decode_metadata`` which checks the format version first, then the structure, then the geometry
(every shard inside its tensor, byte lengths consistent with dtype and box, no two shards of one
file overlapping, the shards of every tensor tiling it exactly (``format.tiling``), sizes and
offsets below ``MAX_BYTES``, ``created_unix`` a real time, no NaN / Infinity literals) so that
nothing downstream allocates or reads from an absurd record or fails to print one. Decoding is
O(n log n) in the number of shards whatever their layout. Only ``CheckpointError`` subclasses
leave ``decode_metadata`` whatever the input bytes (fuzz-tested in
tests/reliability/test_rel_fuzz.py).
Shard tables are stored column-compact: one flat integer list per shard
``[*offsets, *lengths, file_index, byte_offset, byte_length, crc32c]`` (JSON lists below
``TABLE_FROM`` shards, a base64 table of little-endian int64 rows from there on)."""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

import numpy as np

from ..errors import CorruptMetadataError, UnsupportedFormatVersionError
from .dtypes import itemsize
from .records import (
    FORMAT_VERSION,
    BlobRecord,
    Metadata,
    ShardRecord,
    TensorRecord,
    Topology,
)
from .tiling import check_tiling

__all__ = ["encode_metadata", "decode_metadata", "MAGIC", "MAX_BYTES"]

MAGIC = "unickpt"
_MAX_NDIM = 64
# tensors with at least this many shards store them as a binary table (compact, fast to check)
TABLE_FROM = 64
MAX_BYTES = 1 << 56  # 64 PiB: no tensor, shard, file offset or blob is larger (absurd beyond)
_MAX_RANKS = 1 << 31
_YEAR_10000 = 253402300800  # first second of the year 10000 (UTC)


def encode_metadata(md: Metadata) -> bytes:
    tensors = {}
    for fqn, t in md.tensors.items():
        rows = [[*s.offsets, *s.lengths, s.file_index, s.byte_offset, s.byte_length, s.crc32c] for s in t.shards]
        entry: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape)}
        if len(rows) >= TABLE_FROM:
            entry["shard_table"] = base64.b64encode(np.asarray(rows, dtype="<i8").tobytes()).decode("ascii")
        else:
            entry["shards"] = rows
        tensors[fqn] = entry
    doc = {
        "magic": MAGIC,
        "format_version": md.format_version,
        "save_id": md.save_id,
        "created_unix": md.created_unix,
        "role": md.role,
        "topology": {
            "framework": md.topology.framework,
            "world_size": md.topology.world_size,
            "mesh": [[name, size] for name, size in md.topology.mesh],
        },
        "files": list(md.files),
        "tensors": tensors,
        "objects": md.objects,
        "blobs": {k: [b.file_index, b.byte_offset, b.byte_length, b.crc32c] for k, b in md.blobs.items()},
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _fail(source: str, what: str) -> CorruptMetadataError:
    return CorruptMetadataError(f"corrupt checkpoint metadata {source}: {what}")


def _int(v: Any, source: str, what: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _fail(source, f"{what} must be an integer in [{lo}, {hi}], got {_short(v)}")
    return v


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")  # the encoder writes strict JSON (allow_nan=False)


def _created(v: Any, source: str) -> float:
    """``created_unix``: seconds since the epoch, finite and before the year 10000 (tools print it)."""
    if type(v) not in (int, float) or not 0 <= v < _YEAR_10000:
        raise _fail(source, f"created_unix must be a time in seconds since 1970, got {_short(v)}")
    return float(v)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def decode_metadata(data: bytes, source: str = "<metadata>") -> Metadata:
    """Parse and validate metadata bytes read from ``source`` (a path, for messages)."""
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, int too long
        raise _fail(source, f"not valid JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("magic") != MAGIC:
        raise _fail(source, "missing unickpt magic")
    version = doc.get("format_version")
    if type(version) is not int:
        raise _fail(source, f"format_version must be an integer, got {version!r}")
    if version > FORMAT_VERSION or version < 1:
        raise UnsupportedFormatVersionError(
            f"checkpoint {source} has format version {version}; this unickpt reads versions "
            f"1..{FORMAT_VERSION}. Upgrade unickpt to load it."
        )
    try:
        return _decode_v1(doc, source)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
        if isinstance(e, CorruptMetadataError):
            raise
        raise _fail(source, f"{e.__class__.__name__}: {e}") from None


def _decode_v1(doc: dict[str, Any], source: str) -> Metadata:
    files = doc["files"]
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise _fail(source, "files must be a list of strings")
    for f in files:
        if f.startswith("/") or ".." in f.split("/") or "\\" in f or not f:
            raise _fail(source, f"file name {f!r} escapes the checkpoint folder")
    nfiles = len(files)
    topo = doc["topology"]
    topology = Topology(
        framework=str(topo["framework"]),
        world_size=_int(topo["world_size"], source, "topology.world_size", 1, _MAX_RANKS),
        mesh=tuple((str(n), _int(s, source, "topology.mesh size", 1, _MAX_RANKS)) for n, s in topo["mesh"]),
    )
    ranges_by_file: dict[int, list[tuple[int, int, str]]] = {}
    tensors: dict[str, TensorRecord] = {}
    raw_tensors = doc["tensors"]
    if not isinstance(raw_tensors, dict):
        raise _fail(source, "tensors must be an object")
    for fqn, t in raw_tensors.items():
        dtype = t["dtype"]
        if not isinstance(dtype, str):
            raise _fail(source, f"tensor {fqn!r}: dtype must be a string")
        try:
            isz = itemsize(dtype)
        except CorruptMetadataError:
            raise _fail(source, f"tensor {fqn!r}: unknown dtype {dtype!r}") from None
        if not isinstance(t["shape"], list) or len(t["shape"]) > _MAX_NDIM:
            raise _fail(source, f"tensor {fqn!r}: shape must be a list of at most {_MAX_NDIM} sizes")
        shape = tuple(_int(d, source, f"tensor {fqn!r} shape", 0) for d in t["shape"])
        ndim = len(shape)
        if math.prod(shape) * isz > MAX_BYTES:
            raise _fail(source, f"tensor {fqn!r}: shape {shape} is absurdly large")
        if "shard_table" in t:
            shards, offsets, lengths = _decode_table(fqn, t["shard_table"], shape, isz, nfiles, source)
            for sh in shards:
                ranges_by_file.setdefault(sh.file_index, []).append((sh.byte_offset, sh.byte_length, fqn))
            _check_tiling(fqn, shape, offsets, lengths, source)
            tensors[fqn] = TensorRecord(fqn, dtype, shape, tuple(shards))
            continue
        if not isinstance(t["shards"], list):
            raise _fail(source, f"tensor {fqn!r}: shards must be a list")
        shards = []
        for row in t["shards"]:
            if not isinstance(row, list) or len(row) != 2 * ndim + 4:
                raise _fail(source, f"tensor {fqn!r}: shard entry has the wrong length")
            vals = [_int(v, source, f"tensor {fqn!r} shard field", 0) for v in row]
            offs, lens = tuple(vals[:ndim]), tuple(vals[ndim : 2 * ndim])
            fidx, boff, blen, crc = vals[2 * ndim :]
            for d in range(ndim):
                if offs[d] + lens[d] > shape[d]:
                    raise _fail(source, f"tensor {fqn!r}: shard {offs}+{lens} outside shape {shape}")
            if fidx >= nfiles:
                raise _fail(source, f"tensor {fqn!r}: shard names file #{fidx} of {nfiles}")
            if boff + blen > MAX_BYTES:
                raise _fail(source, f"tensor {fqn!r}: shard byte range [{boff}, {boff + blen}) is absurd")
            if blen != math.prod(lens) * isz:
                raise _fail(source, f"tensor {fqn!r}: shard byte length {blen} != box size")
            if crc >= 1 << 32:
                raise _fail(source, f"tensor {fqn!r}: checksum out of range")
            ranges_by_file.setdefault(fidx, []).append((boff, blen, fqn))
            shards.append(ShardRecord(offs, lens, fidx, boff, blen, crc))
        _check_tiling(fqn, shape, *_boxes(shards, ndim), source)
        tensors[fqn] = TensorRecord(fqn, dtype, shape, tuple(shards))
    blobs = {}
    raw_blobs = doc.get("blobs", {})
    if not isinstance(raw_blobs, dict):
        raise _fail(source, "blobs must be an object")
    for key, row in raw_blobs.items():
        if not isinstance(row, list) or len(row) != 4:
            raise _fail(source, f"blob {key!r}: entry must be [file, offset, length, crc32c]")
        fidx, boff, blen, crc = (_int(v, source, f"blob {key!r} field", 0) for v in row)
        if fidx >= nfiles:
            raise _fail(source, f"blob {key!r} names file #{fidx} of {nfiles}")
        if boff + blen > MAX_BYTES or crc >= 1 << 32:
            raise _fail(source, f"blob {key!r}: byte range [{boff}, {boff + blen}) or checksum is absurd")
        ranges_by_file.setdefault(fidx, []).append((boff, blen, key))
        blobs[key] = BlobRecord(key, fidx, boff, blen, crc)
    for fidx, ranges in ranges_by_file.items():
        ranges.sort()
        for (a_off, a_len, a_key), (b_off, _b_len, b_key) in zip(ranges, ranges[1:]):
            if a_off + a_len > b_off:
                raise _fail(source, f"byte ranges of {a_key!r} and {b_key!r} overlap in {files[fidx]}")
    objects = doc.get("objects", {})
    if not isinstance(objects, dict):
        raise _fail(source, "objects must be an object")
    created = _created(doc["created_unix"], source)
    role = doc.get("role")
    if role is not None and not isinstance(role, str):
        raise _fail(source, "role must be a string")
    save_id = doc["save_id"]
    if not isinstance(save_id, str):
        raise _fail(source, "save_id must be a string")
    return Metadata(
        format_version=doc["format_version"],
        save_id=save_id,
        created_unix=created,
        topology=topology,
        files=tuple(files),
        tensors=tensors,
        objects=objects,
        blobs=blobs,
        role=role,
    )


def _boxes(shards: list[ShardRecord], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """The shards' offsets and lengths as (n, ndim) int64 arrays (validated: below MAX_BYTES)."""
    offsets = np.array([s.offsets for s in shards], dtype=np.int64).reshape(len(shards), ndim)
    lengths = np.array([s.lengths for s in shards], dtype=np.int64).reshape(len(shards), ndim)
    return offsets, lengths


def _decode_table(
    fqn: str, table: Any, shape: tuple[int, ...], isz: int, nfiles: int, source: str
) -> tuple[list[ShardRecord], np.ndarray, np.ndarray]:
    """Decode and validate a binary shard table (rows of little-endian int64), vectorised.
    Returns the shards and their offsets and lengths as (n, ndim) arrays."""
    if not isinstance(table, str):
        raise _fail(source, f"tensor {fqn!r}: shard_table must be a base64 string")
    try:
        raw = base64.b64decode(table, validate=True)
    except (ValueError, binascii.Error):
        raise _fail(source, f"tensor {fqn!r}: shard_table is not valid base64") from None
    width = 2 * len(shape) + 4
    if len(raw) % (8 * width):
        raise _fail(source, f"tensor {fqn!r}: shard_table length {len(raw)} is not a multiple of its rows")
    arr = np.frombuffer(raw, dtype="<i8").reshape(-1, width)
    nd = len(shape)
    offs, lens = arr[:, :nd], arr[:, nd : 2 * nd]
    fidx, boff, blen, crc = (arr[:, 2 * nd + i] for i in range(4))
    problems = [
        ((arr < 0).any(axis=1), "negative field"),
        ((arr > MAX_BYTES).any(axis=1), "absurd value"),
        ((offs + lens > np.asarray(shape, dtype=np.int64)).any(axis=1), f"box outside shape {shape}"),
        (fidx >= nfiles, f"file index beyond the {nfiles} files"),
        (boff + blen > MAX_BYTES, "absurd byte range"),
        (blen != np.prod(lens, axis=1, dtype=np.int64) * isz, "byte length != box size"),
        (crc >= 1 << 32, "checksum out of range"),
    ]
    for mask, what in problems:
        bad = np.nonzero(mask)[0]
        if len(bad):
            raise _fail(source, f"tensor {fqn!r}: shard row {int(bad[0])}: {what}")
    shards = [
        ShardRecord(tuple(r[:nd]), tuple(r[nd : 2 * nd]), r[2 * nd], r[2 * nd + 1], r[2 * nd + 2], r[2 * nd + 3])
        for r in arr.tolist()
    ]
    return shards, offs, lens


def _check_tiling(fqn: str, shape: tuple[int, ...], offsets: np.ndarray, lengths: np.ndarray, source: str) -> None:
    """The shards of one tensor cover it exactly once (else a load would silently keep stale
    values where a shard is missing, or copy some elements twice): ``format.tiling``, O(n log n)
    for the layouts savers produce and bounded for any other."""
    problem = check_tiling(shape, offsets, lengths)
    if problem is not None:
        raise _fail(source, f"tensor {fqn!r}: {problem}")
