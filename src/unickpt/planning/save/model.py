"""The save plan's records (imports nothing else of planning).

Every rank describes what it holds as a ``LocalSavePlan``; the coordinator's planner
(``planning.save.plan.plan_save``) turns all of them into one ``GlobalSavePlan``, whose part for
each rank is a ``RankSavePlan``: the ``WriteEntry``s that put the rank's items into its data
files. Plans name data files by (rank, part) only (``file_name``); the save id is applied where
files are opened and recorded (``data_path``: the writer, the commit's checks and metadata), so a
cached plan serves later saves unchanged: only its ``save_id`` field is set anew.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from ...format.records import data_path
from ..specs import BlobSpec, Shape, ShardSpec

__all__ = [
    "ENTRY_ALIGN",
    "LocalSavePlan",
    "WriteEntry",
    "RankSavePlan",
    "RankPlans",
    "GlobalSavePlan",
    "file_name",
    "data_path",
    "rank_plan_rows",
]

# every entry starts at a multiple of this (element-aligned views, cache-line aligned copies)
ENTRY_ALIGN = 64


def file_name(rank: int, part: int) -> str:
    """The name of rank ``rank``'s data file ``part`` inside its save's data folder."""
    return f"r{rank:05d}-{part:02d}.bin"


@dataclass(frozen=True, slots=True)
class LocalSavePlan:
    rank: int
    shards: tuple[ShardSpec, ...]
    blobs: tuple[BlobSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class WriteEntry:
    """Write local item ``item_index`` (or blob when ``blob_key`` is set) at ``byte_offset`` of
    data file ``file`` (a ``file_name``)."""

    item_index: int
    file: str
    byte_offset: int
    byte_length: int
    blob_key: str = ""


@dataclass(frozen=True, slots=True)
class RankSavePlan:
    rank: int
    save_id: str
    entries: tuple[WriteEntry, ...]  # grouped by file, in byte order

    @property
    def files(self) -> tuple[str, ...]:
        """The names of this rank's data files, in order."""
        return tuple(dict.fromkeys(e.file for e in self.entries))

    @property
    def paths(self) -> tuple[str, ...]:
        """This rank's data files in the checkpoint folder (under this save's data folder)."""
        return tuple(data_path(self.save_id, f) for f in self.files)

    @property
    def nbytes(self) -> int:
        return sum(e.byte_length for e in self.entries)


class RankPlans(Protocol):
    """Every rank's part of a plan computed when asked (``planning.save.templates``)."""

    def __len__(self) -> int: ...
    def __getitem__(self, rank: int) -> RankSavePlan: ...
    def __iter__(self) -> Iterator[RankSavePlan]: ...
    def with_save_id(self, save_id: str) -> RankPlans: ...
    def rank_rows(self, rank: int) -> tuple[list[str], np.ndarray, list[str]]: ...
    def explicit_entries(self) -> Iterator[tuple[int, WriteEntry]]: ...
    def file_ends(self) -> dict[str, tuple[int, int]]: ...


@dataclass(frozen=True, slots=True)
class GlobalSavePlan:
    save_id: str
    # every rank's part: a tuple, or (regular jobs) computed when asked
    rank_plans: tuple[RankSavePlan, ...] | RankPlans
    files: tuple[str, ...]  # every data file's name (``file_name``), in the metadata's order
    tensors: dict[str, tuple[str, Shape]]  # fqn -> (dtype, global shape)
    # (fqn, offsets, lengths, rank, item_index): which rank writes each kept box outside the layouts
    writers: tuple[tuple[str, Shape, Shape, int, int], ...]
    # split layouts (planning.save.split): per layout, the index in ``files`` of each part's
    # file (part r: rank r's) and its tensors in byte order with the dimension they are split along
    layouts: tuple[tuple[tuple[int, ...], tuple[tuple[str, int], ...]], ...] = ()

    def with_save_id(self, save_id: str) -> GlobalSavePlan:
        """This plan for save ``save_id`` (file names and entries are shared, not copied)."""
        if self.save_id == save_id:
            return self
        if isinstance(self.rank_plans, tuple):
            parts = tuple(replace(p, save_id=save_id) for p in self.rank_plans)
            return replace(self, save_id=save_id, rank_plans=parts)
        return replace(self, save_id=save_id, rank_plans=self.rank_plans.with_save_id(save_id))

    def rank_rows(self, rank: int) -> tuple[list[str], np.ndarray, list[str]]:
        """Rank ``rank``'s part as columns (what ``wire.encode_rank_rows`` sends): its files, one
        row per entry (item index, file index, byte offset, byte length, blob index or -1), its
        blob keys."""
        if not isinstance(self.rank_plans, tuple):
            return self.rank_plans.rank_rows(rank)
        return rank_plan_rows(self.rank_plans[rank])

    def explicit_entries(self) -> Iterator[tuple[int, WriteEntry]]:
        """(rank, entry) of at least every entry outside the layouts (the metadata's rows and
        blobs; a tuple of rank plans lists all its entries)."""
        if not isinstance(self.rank_plans, tuple):
            return self.rank_plans.explicit_entries()
        return ((rp.rank, e) for rp in self.rank_plans for e in rp.entries)

    def file_ends(self) -> dict[str, tuple[int, int]]:
        """Every data file's planned size and the rank writing it, by file name."""
        if not isinstance(self.rank_plans, tuple):
            return self.rank_plans.file_ends()
        want: dict[str, tuple[int, int]] = {}
        for rp in self.rank_plans:
            for e in rp.entries:
                want[e.file] = (max(want.get(e.file, (0, 0))[0], e.byte_offset + e.byte_length), rp.rank)
        return want


def rank_plan_rows(plan: RankSavePlan) -> tuple[list[str], np.ndarray, list[str]]:
    """``GlobalSavePlan.rank_rows`` of one ``RankSavePlan``."""
    files: dict[str, int] = {}
    blobs: dict[str, int] = {}
    entries = plan.entries
    rows = np.empty((len(entries), 5), dtype=np.int64)
    rows[:, 0] = [e.item_index for e in entries]
    rows[:, 1] = [files.setdefault(e.file, len(files)) for e in entries]
    rows[:, 2] = [e.byte_offset for e in entries]
    rows[:, 3] = [e.byte_length for e in entries]
    rows[:, 4] = [blobs.setdefault(e.blob_key, len(blobs)) if e.blob_key else -1 for e in entries]
    return list(files), rows, list(blobs)
