"""Where the saved shards of a job's needs lie, for many needs at once (pure, numpy).

Called by the coordinator's read assignment (``planning.read_columns``): ``ShardLookup(md,
tensors)`` is prepared once for the tensors a job's needs name (their layouts and listed
shards), then asked for the byte lengths (``lengths``) or the whole geometry (``geometry``) of
any subset of needs, as often as the caller's blocks require. Regular layouts' chunks are
computed (``SplitLayout.lengths`` / ``locations``), listed shards read from their records:
``format.layouts.shard_location`` / ``shard_row_bytes`` over arrays.
"""

from __future__ import annotations

import numpy as np

from ..format.dtypes import itemsize
from ..format.layouts import SplitLayout, SplitShards
from ..format.records import Metadata

__all__ = ["ShardLookup", "shard_geometry", "BLOCK"]

BLOCK = 1 << 20  # needs per block of a vectorised pass: its temporaries stay small and are reused
Geometry = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # files, offsets, lengths, row bytes
Tables = list[tuple[np.ndarray, np.ndarray] | None]  # per layout: SplitLayout.offset_table, or None


class ShardLookup:
    """Shard lookups for needs of the tensors numbered ``tensors`` (their numbers in the
    metadata's order; repeats allowed)."""

    def __init__(self, md: Metadata, tensors: np.ndarray, block: int = BLOCK) -> None:
        records = list(md.tensors.values())
        used = np.zeros(len(records) + 1, dtype=bool)
        for a in range(0, len(tensors), block):
            used[tensors[a : a + block]] = True
        grouped: dict[int, tuple[SplitLayout, list[int], list[int]]] = {}  # id -> (layout, tensors, entries)
        listed: list[int] = []
        for t in np.flatnonzero(used[:-1]).tolist():
            shards = records[t].shards
            if isinstance(shards, SplitShards):
                _, ts, es = grouped.setdefault(id(shards.layout), (shards.layout, [], []))
                ts.append(t)
                es.append(shards.entry)
            else:
                listed.append(t)
        # per layout: the entry of each of its tensors (-1 for the others)
        self._layouts: list[tuple[SplitLayout, np.ndarray]] = []
        for layout, ts, es in grouped.values():
            entry_of = np.full(len(records), -1, dtype=np.int64)
            entry_of[ts] = es
            self._layouts.append((layout, entry_of))
        # listed shards: one row each (file, offset, length, row bytes), a tensor's from first[t]
        self._first = np.zeros(len(records), dtype=np.int64)
        self._listed = np.zeros(len(records), dtype=bool)
        found: list[tuple[int, int, int, int]] = []
        for t in listed:
            rec = records[t]
            self._first[t] = len(found)
            isz = itemsize(rec.dtype)
            for s in rec.shards:
                rb = int(np.prod(s.lengths[1:], dtype=np.int64)) * isz if s.lengths else isz
                found.append((s.file_index, s.byte_offset, s.byte_length, rb))
        self._rows = np.asarray(found, dtype=np.int64).reshape(-1, 4)
        self._listed[listed] = True
        self._any_listed = bool(listed)
        self._block = block

    def lengths(self, tensor: np.ndarray, shard: np.ndarray) -> np.ndarray:
        """The byte length of each need's shard."""
        return self._each(tensor, shard, None)[0]

    def geometry(self, tensor: np.ndarray, shard: np.ndarray) -> Geometry:
        """(file index, byte offset, byte length, bytes per row of the first dimension) of each
        need's shard. Each layout's byte offsets are computed once, for the parts asked."""
        return self.located(tensor, shard, self.tables(tensor, shard))

    def tables(self, tensor: np.ndarray, shard: np.ndarray) -> Tables:
        """Each layout's byte offsets of the parts the needs ``(tensor, shard)`` ask (None for
        a layout they do not ask), for ``located`` on those needs or any part of them."""
        tables: Tables = []
        for layout, entry_of in self._layouts:
            parts = np.zeros(max(1, layout.parts), dtype=bool)
            for a in range(0, len(tensor), self._block):
                mine = entry_of[tensor[a : a + self._block]] >= 0
                parts[shard[a : a + self._block][mine]] = True
            asked = np.flatnonzero(parts)
            tables.append(layout.offset_table(asked) if len(asked) else None)  # None: no need of it here
        return tables

    def located(self, tensor: np.ndarray, shard: np.ndarray, tables: Tables) -> Geometry:
        """``geometry`` with the offset ``tables`` of needs that include these."""
        out = self._each(tensor, shard, tables)
        return out[0], out[1], out[2], out[3]

    def _each(self, tensor: np.ndarray, shard: np.ndarray, tables: Tables | None) -> list[np.ndarray]:
        """Lengths (``tables`` None) or the whole geometry, in blocks (only the answer is
        allocated whole)."""
        n = len(tensor)
        kinds = (np.int32, np.int64, np.int64, np.int64) if tables is not None else (np.int64,)  # files fit 32 bits
        out = [np.zeros(n, dtype=k) for k in kinds]
        rows = self._rows if tables is not None else self._rows[:, 2:3]
        for a in range(0, n, self._block):  # each need's values from its layout or its listed shard
            tb, sh = tensor[a : a + self._block], shard[a : a + self._block].astype(np.int64)
            for i, (layout, entry_of) in enumerate(self._layouts):
                table = tables[i] if tables is not None else None
                if tables is not None and table is None:
                    continue  # no need of this layout here
                entries = entry_of[tb]
                mine = np.flatnonzero(entries >= 0)
                if not len(mine):
                    continue
                whole = len(mine) == len(tb)  # the block's needs all of this layout: no selection
                e, p = (entries, sh) if whole else (entries[mine], sh[mine])
                got = (layout.lengths(e, p),) if table is None else layout.locations(e, p, table)
                for column, values in zip(out, got):
                    if whole:
                        column[a : a + len(tb)] = values
                    else:
                        column[a + mine] = values
            if self._any_listed:
                mine = np.flatnonzero(self._listed[tb])
                at = self._first[tb[mine]] + sh[mine]
                for column, values in zip(out, rows.T):
                    column[a + mine] = values[at]
        return out


def shard_geometry(
    md: Metadata, tensor: np.ndarray, shard: np.ndarray, block: int = BLOCK
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``ShardLookup.geometry`` of the needs ``(tensor, shard)``, computed in blocks of ``block``."""
    return ShardLookup(md, tensor, block).geometry(tensor, shard)
