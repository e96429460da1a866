"""Format version 1: the document layout, its writer and its reader. Frozen: a change to what
version 1 means is a new version (``format.v2`` shows how one reuses these pieces).

A version-1 document is UTF-8 strict JSON (no NaN / Infinity), keys in this order::

    {"magic": "unickpt", "format_version": 1, "save_id": str, "created_unix": seconds,
     "role": str | null,
     "topology": {"framework": str, "world_size": int, "mesh": [[name, size], ...]},
     "files": [data file names, relative to the checkpoint folder],
     "tensors": {fqn: {"dtype": name, "shape": [sizes],
                       "shards": [[*offsets, *lengths, file_index, byte_offset, byte_length, crc32c], ...]
                       | "shard_table": base64 of the same rows as little-endian int64}},
     "objects": {name: JSON},
     "blobs": {key: [file_index, byte_offset, byte_length, crc32c]}}

Shard rows are JSON lists below ``TABLE_FROM`` shards per tensor, a binary table from there on.
Readers ignore top-level keys they do not know.

Each shard row and blob carries the CRC32C of its bytes: in memory a ``RangeChecksums``
(``format.checksums``), so only metadata whose checksums are of that kind can be written in this
version (saves write version 3, whose checksums cover file chunks).

Pieces later versions reuse: :func:`write_body` (every version-1 key, under a given version
number) and :func:`read_body` (parse and validate them, collecting problems), and the small
parsers (``_part``, ``_int``, ``_table``...). Validation itself is ``format.validation``'s: this
module only parses types and hands the shard rows over.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import numpy as np

from .checksums import RangeChecksums
from .records import BlobRecord, Metadata, ShardRecord, TensorRecord, Topology
from .sections import SectionRegistry
from .validation import (
    CRC_LIMIT,
    MAX_BYTES,
    MAX_NDIM,
    Problems,
    RangeGroup,
    blob_problems,
    byte_range_problems,
    corrupt,
    file_name_problems,
    tensor_problems,
)

__all__ = ["VERSION", "MAGIC", "TABLE_FROM", "write_body", "read_body", "V1Reader", "V1Writer", "READER", "WRITER"]

T = TypeVar("T")

VERSION = 1
MAGIC = "unickpt"
TABLE_FROM = 64  # tensors with at least this many shards store them as a binary table
_MAX_RANKS = 1 << 31
_YEAR_10000 = 253402300800  # first second of the year 10000 (UTC)
_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError)

Ranges = list[RangeGroup]


# --------------------------------------------------------------------------- writing


def write_body(md: Metadata, version: int) -> dict[str, Any]:
    """Every version-1 key of ``md``, with ``format_version`` = ``version`` (``md.checksums`` must
    be a ``RangeChecksums`` with a unit for every shard and blob: KeyError otherwise)."""
    sums = md.checksums
    if not isinstance(sums, RangeChecksums):
        raise TypeError("format versions 1 and 2 carry one checksum per shard and blob (RangeChecksums)")
    crc = sums.crc_of
    tensors = {}
    for fqn, t in md.tensors.items():
        rows = [
            [
                *s.offsets,
                *s.lengths,
                s.file_index,
                s.byte_offset,
                s.byte_length,
                crc(s.file_index, s.byte_offset, s.byte_length),
            ]
            for s in t.shards
        ]
        tensors[fqn] = tensor_entry(t.dtype, t.shape, rows)
    return {
        **write_head(md, version),
        "tensors": tensors,
        "objects": md.objects,
        "blobs": {
            k: [b.file_index, b.byte_offset, b.byte_length, crc(b.file_index, b.byte_offset, b.byte_length)]
            for k, b in md.blobs.items()
        },
    }


def write_head(md: Metadata, version: int) -> dict[str, Any]:
    """The keys every version starts with: magic, version, save id, time, role, topology, files."""
    return {
        "magic": MAGIC,
        "format_version": version,
        "save_id": md.save_id,
        "created_unix": md.created_unix,
        "role": md.role,
        "topology": {
            "framework": md.topology.framework,
            "world_size": md.topology.world_size,
            "mesh": [[name, size] for name, size in md.topology.mesh],
        },
        "files": list(md.files),
    }


def tensor_entry(dtype: str, shape: tuple[int, ...], rows: list[list[int]]) -> dict[str, Any]:
    """A tensor's entry: dtype, shape and its shard rows, as a binary table from ``TABLE_FROM`` rows."""
    entry: dict[str, Any] = {"dtype": dtype, "shape": list(shape)}
    if len(rows) >= TABLE_FROM:
        entry["shard_table"] = base64.b64encode(np.asarray(rows, dtype="<i8").tobytes()).decode("ascii")
    else:
        entry["shards"] = rows
    return entry


class V1Writer:
    """Writes metadata without sections (version 1 has no place for them)."""

    def can_write(self, md: Metadata, sections: SectionRegistry) -> bool:
        return not md.sections and isinstance(md.checksums, RangeChecksums)

    def write(self, md: Metadata, sections: SectionRegistry) -> dict[str, Any]:
        return write_body(md, VERSION)


# --------------------------------------------------------------------------- reading


class _Bad(Exception):
    """One problem that ends the parsing of one part of the document (a tensor, a blob, a field)."""


class V1Reader:
    """Reads a version-1 document (``format.codec`` checked the magic and the version)."""

    def read(self, doc: dict[str, Any], source: str, sections: SectionRegistry) -> Metadata:
        problems = Problems()
        md = read_body(doc, VERSION, problems)
        problems.raise_if_any(lambda text: corrupt(source, text))
        assert md is not None
        return md


def read_body(doc: dict[str, Any], version: int, problems: Problems) -> Metadata | None:
    """Parse and validate every version-1 key of ``doc``; a ``Metadata`` of ``version`` (no
    sections), or None when ``problems`` received any. Each part (a field, a tensor, a blob) is
    parsed on its own, so one decode reports the problems of every part."""
    files = _part(problems, "files", lambda: _files(doc))
    nfiles = len(files) if files is not None else None
    if files is not None:
        problems.extend(file_name_problems(files))
    topology = _part(problems, "topology", lambda: _topology(doc))
    ranges: Ranges = []
    units: list[tuple[int, int, int, int]] = []  # (file, offset, length, crc32c) of every shard and blob
    tensors = _tensors(doc, nfiles, problems, ranges, units)
    blobs = _blobs(doc, nfiles, problems, ranges, units)
    if files is not None:
        problems.extend(byte_range_problems(files, ranges))
    objects = _part(problems, "objects", lambda: _typed(doc.get("objects", {}), dict, "objects must be an object"))
    created = _part(problems, "created_unix", lambda: _created(_field(doc, "created_unix")))
    role = _part(problems, "role", lambda: _role(doc.get("role")))
    save_id = _part(problems, "save_id", lambda: _typed(_field(doc, "save_id"), str, "save_id must be a string"))
    if problems:
        return None
    assert files is not None and topology is not None and objects is not None
    assert created is not None and save_id is not None and tensors is not None and blobs is not None
    return Metadata(
        format_version=version,
        save_id=save_id,
        created_unix=created,
        topology=topology,
        files=tuple(files),
        tensors=tensors,
        objects=objects,
        blobs=blobs,
        role=role,
        checksums=RangeChecksums(tuple(units)),
    )


def _part(problems: Problems, what: str, parse: Callable[[], T]) -> T | None:
    """``parse()``, or None with its problem recorded (nothing but a sentence leaves a part)."""
    try:
        return parse()
    except _Bad as e:
        problems.add(str(e))
    except _ERRORS as e:
        text = str(e)
        problems.add(f"{what}: {e.__class__.__name__}: {text if len(text) <= 200 else text[:197] + '...'}")
    return None


def _field(d: Any, key: str, owner: str = "") -> Any:
    if not isinstance(d, dict) or key not in d:
        raise _Bad(f"{owner}missing field {key!r}")
    return d[key]


def _typed(v: Any, kind: type[T], message: str) -> T:
    if not isinstance(v, kind):
        raise _Bad(message)
    return v


def _int(v: Any, what: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _Bad(f"{what} must be an integer in [{lo}, {hi}], got {_short(v)}")
    return v


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _files(doc: dict[str, Any]) -> list[str]:
    files = _field(doc, "files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise _Bad("files must be a list of strings")
    return files


def _topology(doc: dict[str, Any]) -> Topology:
    topo = _field(doc, "topology")
    return Topology(
        framework=str(_field(topo, "framework", "topology: ")),
        world_size=_int(_field(topo, "world_size", "topology: "), "topology.world_size", 1, _MAX_RANKS),
        mesh=tuple(
            (str(n), _int(s, "topology.mesh size", 1, _MAX_RANKS)) for n, s in _field(topo, "mesh", "topology: ")
        ),
    )


def _created(v: Any) -> float:
    """``created_unix``: seconds since the epoch, finite and before the year 10000 (tools print it)."""
    if type(v) not in (int, float) or not 0 <= v < _YEAR_10000:
        raise _Bad(f"created_unix must be a time in seconds since 1970, got {_short(v)}")
    return float(v)


def _role(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise _Bad("role must be a string")
    return v


def _tensors(
    doc: dict[str, Any], nfiles: int | None, problems: Problems, ranges: Ranges, units: list[tuple[int, int, int, int]]
) -> dict[str, TensorRecord]:
    raw = _part(problems, "tensors", lambda: _typed(_field(doc, "tensors"), dict, "tensors must be an object"))
    tensors: dict[str, TensorRecord] = {}
    for fqn, entry in (raw or {}).items():
        parsed = _part(problems, f"tensor {fqn!r}", partial(_tensor, fqn, entry))
        if parsed is None:
            continue
        dtype, shape, table = parsed
        crcs = table[:, -1]
        bad = np.flatnonzero((crcs < 0) | (crcs >= CRC_LIMIT))
        if len(bad):
            problems.add(f"tensor {fqn!r}: shard row {int(bad[0])}: checksum {int(crcs[bad[0]])} out of range")
            continue
        table = table[:, :-1]
        found = tensor_problems(fqn, shape, dtype, table, nfiles)
        if found:
            problems.extend(found)
            continue
        nd = len(shape)
        ranges.append((fqn, table[:, 2 * nd], table[:, 2 * nd + 1], table[:, 2 * nd + 2]))
        if not problems:  # records only for a document that may still decode
            f = 2 * nd
            rows = table.tolist()
            shards = tuple(ShardRecord(tuple(r[:nd]), tuple(r[nd:f]), r[f], r[f + 1], r[f + 2]) for r in rows)
            units.extend((r[f], r[f + 1], r[f + 2], c) for r, c in zip(rows, crcs.tolist()))
            tensors[fqn] = TensorRecord(fqn, dtype, shape, shards)
    return tensors


def _tensor(fqn: str, t: Any) -> tuple[str, tuple[int, ...], np.ndarray]:
    """dtype, shape and the shard rows of one tensor entry, type-checked (bounds: validation)."""
    head = f"tensor {fqn!r}: "
    dtype = _field(t, "dtype", head)
    if not isinstance(dtype, str):
        raise _Bad(f"{head}dtype must be a string")
    raw_shape = _field(t, "shape", head)
    if not isinstance(raw_shape, list) or len(raw_shape) > MAX_NDIM:
        raise _Bad(f"{head}shape must be a list of at most {MAX_NDIM} sizes")
    shape = tuple(_int(d, f"tensor {fqn!r} shape") for d in raw_shape)
    width = 2 * len(shape) + 4
    if "shard_table" in t:
        return dtype, shape, _table(head, t["shard_table"], width)
    rows = _field(t, "shards", head)
    if not isinstance(rows, list):
        raise _Bad(f"{head}shards must be a list")
    for row in rows:
        if not isinstance(row, list) or len(row) != width:
            raise _Bad(f"{head}shard entry has the wrong length")
        for v in row:
            _int(v, f"tensor {fqn!r} shard field")
    return dtype, shape, np.array(rows, dtype=np.int64).reshape(len(rows), width)


def _table(head: str, table: Any, width: int) -> np.ndarray:
    """A binary shard table: base64 of little-endian int64 rows of ``width`` fields."""
    if not isinstance(table, str):
        raise _Bad(f"{head}shard_table must be a base64 string")
    try:
        raw = base64.b64decode(table, validate=True)
    except (ValueError, binascii.Error):
        raise _Bad(f"{head}shard_table is not valid base64") from None
    if len(raw) % (8 * width):
        raise _Bad(f"{head}shard_table length {len(raw)} is not a multiple of its rows")
    return np.frombuffer(raw, dtype="<i8").reshape(-1, width).astype(np.int64, copy=False)


def _blobs(
    doc: dict[str, Any], nfiles: int | None, problems: Problems, ranges: Ranges, units: list[tuple[int, int, int, int]]
) -> dict[str, BlobRecord]:
    raw = _part(problems, "blobs", lambda: _typed(doc.get("blobs", {}), dict, "blobs must be an object"))
    blobs: dict[str, BlobRecord] = {}
    for key, row in (raw or {}).items():
        parsed = _part(problems, f"blob {key!r}", partial(_blob, key, row))
        if parsed is None:
            continue
        blob, crc = parsed
        found = blob_problems(blob, nfiles)
        if found:
            problems.extend(found)
            continue
        ranges.append((key, *_one_range(blob)))
        units.append((blob.file_index, blob.byte_offset, blob.byte_length, crc))
        blobs[key] = blob
    return blobs


def _one_range(blob: BlobRecord) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A blob's (file_index, byte_offset, byte_length) as one-element arrays."""
    return (
        np.array([blob.file_index], dtype=np.int64),
        np.array([blob.byte_offset], dtype=np.int64),
        np.array([blob.byte_length], dtype=np.int64),
    )


def _blob(key: str, row: Any) -> tuple[BlobRecord, int]:
    if not isinstance(row, list) or len(row) != 4:
        raise _Bad(f"blob {key!r}: entry must be [file, offset, length, crc32c]")
    fidx, boff, blen = (_int(v, f"blob {key!r} field") for v in row[:3])
    return BlobRecord(key, fidx, boff, blen), _int(row[3], f"blob {key!r} checksum", 0, CRC_LIMIT - 1)


READER = V1Reader()
WRITER = V1Writer()
