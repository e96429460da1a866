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
from collections.abc import Sequence
from typing import overload

import numpy as np

from ...errors import PlanningError
from ..specs import BlobSpec, ShardSpec
from .model import LocalSavePlan, RankSavePlan, WriteEntry, rank_plan_rows
from .table import ShardTable

__all__ = [
    "encode_local_plan",
    "decode_local_plan",
    "decode_local_table",
    "LocalPlans",
    "encode_rank_plan",
    "encode_rank_rows",
    "decode_rank_plan",
]

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


def encode_local_plan(plan: LocalSavePlan | ShardTable) -> bytes:
    """Rows: name index, dtype index, ndim, replica source (-1: any), then global shape,
    offsets and lengths (ndim values each); built from the plan's ``ShardTable``."""
    t = plan if isinstance(plan, ShardTable) else ShardTable.of(plan)
    widths = 4 + 3 * t.ndim
    starts = np.zeros(len(t), dtype=np.int64)
    np.cumsum(widths[:-1], out=starts[1:])
    rows = np.empty(int(widths.sum()), dtype=np.int64)
    for k, column in enumerate((t.name, t.dtype, t.ndim, t.source)):
        rows[starts + k] = column
    for nd in np.unique(t.ndim).tolist():
        if nd:
            at = t.ndim == nd
            cells = (starts[at] + 4)[:, None] + np.arange(nd)
            rows[cells] = t.shape[at, :nd]
            rows[cells + nd] = t.offsets[at, :nd]
            rows[cells + 2 * nd] = t.lengths[at, :nd]
    header = {
        "rank": t.rank,
        "n": len(t),
        "names": list(t.names),
        "dtypes": list(t.dtypes),
        "blobs": [[b.key, b.nbytes] for b in t.blobs],
    }
    return _pack(_LOCAL, header, rows)


def decode_local_table(data: bytes) -> ShardTable:
    """The ``ShardTable`` of an encoded local plan (what the coordinator plans with): the rows
    are checked as a whole; a buffer with any problem is decoded by ``decode_local_plan``,
    which raises the ``PlanningError`` naming it."""
    return LocalPlanDecoder().table(data)


class LocalPlans(Sequence[ShardTable]):
    """The gathered local plans of a job as the planner's input: rank ``r``'s ``ShardTable``
    is decoded from its bytes when asked (the regular planner reads one rank at a time, so the
    coordinator never holds every rank's table at once); one ``LocalPlanDecoder`` serves all."""

    def __init__(self, encoded: Sequence[bytes]) -> None:
        self._encoded = encoded
        self._decoder = LocalPlanDecoder()

    def __len__(self) -> int:
        return len(self._encoded)

    @overload
    def __getitem__(self, i: int) -> ShardTable: ...
    @overload
    def __getitem__(self, i: slice) -> list[ShardTable]: ...
    def __getitem__(self, i: int | slice) -> ShardTable | list[ShardTable]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self._decoder.table(self._encoded[i])


class LocalPlanDecoder:
    """Decodes the local plans of many ranks (``LocalPlans``): ranks of one job send rows of one
    shape, so where each row starts, found for one plan by a walk over its rows, is checked for
    the next one as a whole (vectorised) and reused when it fits."""

    def __init__(self) -> None:
        self._starts: np.ndarray | None = None

    def table(self, data: bytes) -> ShardTable:
        header, rows = _unpack(_LOCAL, data, "local save plan")
        try:
            n = int(header["n"])
            starts = self._starts
            if starts is None or len(starts) != n or not _starts_fit(rows, starts):
                starts = self._starts = _row_starts(rows, n)
        except (KeyError, IndexError, TypeError, ValueError, PlanningError):
            return ShardTable.of(decode_local_plan(data))  # raises the precise error
        return _table(data, header, rows, starts)


def _starts_fit(rows: np.ndarray, starts: np.ndarray) -> bool:
    """``starts`` are where the rows of ``rows`` start (each 4 + 3 * its ndim long)."""
    if not len(starts):
        return not len(rows)
    last = int(starts[-1])
    if last + 3 > len(rows):
        return False
    nd = rows[starts + 2]
    return bool((nd >= 0).all() and (np.diff(starts) == 4 + 3 * nd[:-1]).all() and last + 4 + 3 * nd[-1] == len(rows))


def _table(data: bytes, header: dict, rows: np.ndarray, starts: np.ndarray) -> ShardTable:
    """The table of decoded rows whose starts are known."""
    try:
        names, dtypes, rank = header["names"], header["dtypes"], int(header["rank"])
        blobs = tuple(BlobSpec(str(k), int(v)) for k, v in header["blobs"])
    except (KeyError, IndexError, TypeError, ValueError, PlanningError):
        return ShardTable.of(decode_local_plan(data))  # raises the precise error
    if not isinstance(names, list) or not isinstance(dtypes, list):
        return ShardTable.of(decode_local_plan(data))
    n = len(starts)
    ndim = rows[starts + 2]
    width = int(ndim.max(initial=0))
    shape = np.ones((n, width), dtype=np.int64)
    offsets = np.zeros((n, width), dtype=np.int64)
    lengths = np.ones((n, width), dtype=np.int64)
    for nd in np.unique(ndim).tolist():
        if nd:
            at = ndim == nd
            cells = (starts[at] + 4)[:, None] + np.arange(nd)
            shape[at, :nd], offsets[at, :nd], lengths[at, :nd] = rows[cells], rows[cells + nd], rows[cells + 2 * nd]
    source = rows[starts + 3]
    table = ShardTable(
        rank,
        tuple(names),
        tuple(dtypes),
        rows[starts],
        rows[starts + 1],
        ndim,
        np.where(source < 0, -1, source),
        shape,
        offsets,
        lengths,
        blobs,
    )
    if table.box_problem():
        return ShardTable.of(decode_local_plan(data))
    return table


def _row_starts(rows: np.ndarray, n: int) -> np.ndarray:
    """Where each of the ``n`` rows starts (each is 4 + 3 * ndim long); ``PlanningError`` if the
    rows do not end exactly there or an ndim is negative (``LocalPlanDecoder.table`` then decodes
    record by record for the precise error)."""
    values = rows.tolist()
    starts = []
    at, end = 0, len(values)
    for _ in range(n):
        if at + 3 > end or values[at + 2] < 0:
            raise PlanningError("local save plan: truncated rows")
        starts.append(at)
        at += 4 + 3 * values[at + 2]
    if at != end:
        raise PlanningError("local save plan: trailing rows")
    return np.array(starts, dtype=np.int64)


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
    return encode_rank_rows(plan.rank, plan.save_id, *rank_plan_rows(plan))


def encode_rank_rows(rank: int, save_id: str, files: list[str], rows: np.ndarray, blobs: list[str]) -> bytes:
    """``encode_rank_plan`` of a plan given as columns (``GlobalSavePlan.rank_rows``: the
    coordinator encodes each rank's part of a regular plan without building its entries)."""
    header = {"rank": rank, "save_id": save_id, "files": list(files), "blobs": list(blobs)}
    return _pack(_RANK, header, rows)


def decode_rank_plan(data: bytes) -> RankSavePlan:
    header, rows = _unpack(_RANK, data, "rank save plan")
    try:
        files, blobs = header["files"], header["blobs"]
        if rows.size % 5:
            raise PlanningError("rank save plan: truncated rows")
        table = rows.reshape(-1, 5)
        fidx, bidx = table[:, 1], table[:, 4]
        if len(table) and (
            not isinstance(files, list)
            or not isinstance(blobs, list)
            or fidx.min() < 0
            or fidx.max() >= len(files)
            or bidx.min() < -1
            or bidx.max() >= len(blobs)
            or not all(isinstance(f, str) for f in files)
            or not all(isinstance(b, str) for b in blobs)
        ):
            return _decode_rank_rows(header, table)  # raises the precise error
        names = [files[i] for i in fidx.tolist()] if len(table) else []
        keys = [blobs[i] if i != -1 else "" for i in bidx.tolist()]
        entries = tuple(map(WriteEntry, table[:, 0].tolist(), names, table[:, 2].tolist(), table[:, 3].tolist(), keys))
        return RankSavePlan(int(header["rank"]), str(header["save_id"]), entries)
    except PlanningError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise PlanningError(f"rank save plan: malformed ({type(e).__name__}: {e})") from None


def _decode_rank_rows(header: dict, table: np.ndarray) -> RankSavePlan:
    """``decode_rank_plan`` entry by entry: each index checked against its table in turn."""
    files, blobs = header["files"], header["blobs"]
    entries = tuple(
        WriteEntry(item, _at(files, f, "rank save plan"), off, n, _at(blobs, b, "rank save plan") if b != -1 else "")
        for item, f, off, n, b in table.tolist()
    )
    return RankSavePlan(int(header["rank"]), str(header["save_id"]), entries)
