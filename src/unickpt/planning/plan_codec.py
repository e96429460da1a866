"""Compact binary forms of the plans that travel between ranks (never pickle).

``plan_cache.plan_stage`` gathers every rank's ``LocalSavePlan`` at the coordinator and sends
each rank back only its own ``RankSavePlan``; both travel as the bytes made here. A local plan of
``n`` shards costs a small JSON header (the distinct tensor names and dtypes, the blobs) plus
``n`` fixed-width integer rows, instead of ``n`` pickled dataclasses; a rank plan is a header
(the save id, file names, blob keys) plus one 5-integer row per write entry.

Layout of both: ``MAGIC`` (4 bytes) | version (u16) | row width (u8) | body length (u32) |
zlib(header length (u32) | header (UTF-8 JSON) | little-endian integer rows of that width).
Decoding checks every length and index against the buffer it was given and bounds the
decompressed size (``PlanningError`` naming what is wrong), so a truncated or foreign buffer is
refused, not misread.
"""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np

from ..errors import PlanningError
from .save_plan import LocalSavePlan, RankSavePlan, WriteEntry
from .specs import BlobSpec, ShardSpec

__all__ = ["encode_local_plan", "decode_local_plan", "encode_rank_plan", "decode_rank_plan"]

_LOCAL, _RANK = b"UCLP", b"UCRP"
_VERSION = 2
_HEAD = struct.Struct("<4sHBI")  # magic, version, row width in bytes (1, 2, 4, 8), body length
_WIDTHS = {1: "<i1", 2: "<i2", 4: "<i4", 8: "<i8"}
_MAX_BODY = 1 << 30  # a plan's decompressed body is refused beyond this (a foreign buffer)


def _pack(magic: bytes, header: dict, rows: np.ndarray) -> bytes:
    """Header JSON + rows in the narrowest integer width that holds them, zlib-compressed
    (names of one model share long prefixes; level 1 costs well under a millisecond per 100 KB)."""
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    rows = np.asarray(rows, dtype=np.int64)
    big = int(max(rows.max(initial=0), -rows.min(initial=0)))
    width = next(w for w in (1, 2, 4, 8) if big < 1 << (8 * w - 1))
    body = struct.pack("<I", len(head)) + head + np.ascontiguousarray(rows, dtype=_WIDTHS[width]).tobytes()
    return _HEAD.pack(magic, _VERSION, width, len(body)) + zlib.compress(body, 1)


def _unpack(magic: bytes, data: bytes, what: str) -> tuple[dict, np.ndarray]:
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < _HEAD.size:
        raise PlanningError(f"{what}: not an encoded plan ({type(data).__name__})")
    got, version, width, n = _HEAD.unpack_from(data, 0)
    if got != magic or version != _VERSION or width not in _WIDTHS:
        raise PlanningError(f"{what}: not an encoded plan of this unickpt (magic {got!r}, version {version})")
    if n > _MAX_BODY:
        raise PlanningError(f"{what}: claims {n} bytes, over the cap of {_MAX_BODY}")
    try:
        inflate = zlib.decompressobj()
        body = inflate.decompress(bytes(data[_HEAD.size :]), n + 1)
    except zlib.error as e:
        raise PlanningError(f"{what}: corrupt ({e})") from None
    if len(body) != n or inflate.unconsumed_tail or inflate.unused_data or not inflate.eof:
        raise PlanningError(f"{what}: truncated or trailing bytes ({len(body)} of {n})")
    (hlen,) = struct.unpack_from("<I", body, 0) if n >= 4 else (n + 1,)
    end = 4 + hlen
    if end > n or (n - end) % width:
        raise PlanningError(f"{what}: truncated ({n} bytes)")
    try:
        header = json.loads(body[4:end].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise PlanningError(f"{what}: unreadable header ({e})") from None
    if not isinstance(header, dict):
        raise PlanningError(f"{what}: unreadable header")
    return header, np.frombuffer(body, dtype=_WIDTHS[width], offset=end).astype(np.int64)


def _at(table: list, i: int, what: str) -> str:
    """``table[i]`` for an index read from the rows (negative or past the end: refused)."""
    if not 0 <= i < len(table) or not isinstance(table[i], str):
        raise PlanningError(f"{what}: index {i} outside its table of {len(table)}")
    return table[i]


def encode_local_plan(plan: LocalSavePlan) -> bytes:
    """Rows: name index, dtype index, ndim, replica source (-1: any), then global shape,
    offsets and lengths (ndim values each)."""
    names: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    rows: list[int] = []
    for s in plan.shards:
        nd = len(s.global_shape)
        rows += [names.setdefault(s.fqn, len(names)), dtypes.setdefault(s.dtype, len(dtypes)), nd]
        rows.append(-1 if s.replica_source is None else s.replica_source)
        rows += [*s.global_shape, *s.offsets, *s.lengths]
    header = {
        "rank": plan.rank,
        "n": len(plan.shards),
        "names": list(names),
        "dtypes": list(dtypes),
        "blobs": [[b.key, b.nbytes] for b in plan.blobs],
    }
    return _pack(_LOCAL, header, np.array(rows, dtype=np.int64))


def decode_local_plan(data: bytes) -> LocalSavePlan:
    header, rows = _unpack(_LOCAL, data, "local save plan")
    try:
        names, dtypes, n, rank = header["names"], header["dtypes"], int(header["n"]), int(header["rank"])
        blobs = tuple(BlobSpec(str(k), int(v)) for k, v in header["blobs"])
        values = rows.tolist()
        shards, at = [], 0
        for _ in range(n):
            name, dtype, nd, source = values[at : at + 4]
            box = values[at + 4 : at + 4 + 3 * nd]
            if len(box) != 3 * nd or nd < 0:
                raise PlanningError("local save plan: truncated rows")
            fqn, dt = _at(names, name, "local save plan"), _at(dtypes, dtype, "local save plan")
            src = None if source < 0 else source
            shards.append(ShardSpec(fqn, dt, tuple(box[:nd]), tuple(box[nd : 2 * nd]), tuple(box[2 * nd :]), src))
            at += 4 + 3 * nd
        if at != len(values):
            raise PlanningError("local save plan: trailing rows")
    except PlanningError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise PlanningError(f"local save plan: malformed ({type(e).__name__}: {e})") from None
    return LocalSavePlan(rank, tuple(shards), blobs)


def encode_rank_plan(plan: RankSavePlan) -> bytes:
    """Rows: item index, file index, byte offset, byte length, blob index (-1: a tensor)."""
    files: dict[str, int] = {}
    blobs: dict[str, int] = {}
    rows = np.empty((len(plan.entries), 5), dtype=np.int64)
    for i, e in enumerate(plan.entries):
        blob = blobs.setdefault(e.blob_key, len(blobs)) if e.blob_key else -1
        rows[i] = (e.item_index, files.setdefault(e.file, len(files)), e.byte_offset, e.byte_length, blob)
    header = {"rank": plan.rank, "save_id": plan.save_id, "files": list(files), "blobs": list(blobs)}
    return _pack(_RANK, header, rows)


def decode_rank_plan(data: bytes) -> RankSavePlan:
    header, rows = _unpack(_RANK, data, "rank save plan")
    try:
        files, blobs = header["files"], header["blobs"]
        if rows.size % 5:
            raise PlanningError("rank save plan: truncated rows")
        entries = tuple(
            WriteEntry(
                item, _at(files, f, "rank save plan"), off, n, _at(blobs, b, "rank save plan") if b != -1 else ""
            )
            for item, f, off, n, b in rows.reshape(-1, 5).tolist()
        )
        return RankSavePlan(int(header["rank"]), str(header["save_id"]), entries)
    except PlanningError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise PlanningError(f"rank save plan: malformed ({type(e).__name__}: {e})") from None
