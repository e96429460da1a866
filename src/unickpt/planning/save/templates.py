"""Rank groups and lazily computed rank plans: the save planner's compression of a job.

``plan.plan_save`` reads the ranks' local plans one at a time (``group_ranks``; bytes are decoded
here and dropped: the coordinator never holds every rank's table at once) and reduces each to a
*template*: its rows with the boxes of the rows that are ``torch.chunk`` part r of their tensor
(rank r: ``chunk_rule``) replaced by that rule. Ranks whose templates are equal form one group:
an FSDP job of 4,096 ranks is one group, a DDP job too; an irregular job is one group per rank.
The planner then works on the groups' tables (``rows.JobRows``), and its result keeps the groups:
``RegularRankPlans`` computes a rank's entries when asked (``plan_stage`` encodes each rank's
part from its columns, ``rank_rows``), never holding every rank's entries.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import PlanningError
from ..specs import BlobSpec
from .layout import stack
from .model import LocalSavePlan, RankSavePlan, WriteEntry, file_name
from .split import chunk_dims
from .table import ShardTable

__all__ = ["chunk_rule", "RankGroup", "group_ranks", "SplitTensors", "RegularRankPlans"]


def chunk_rule(t: ShardTable, world: int) -> np.ndarray:
    """Per row of ``t`` (rank ``t.rank`` of ``world``): the dimension ``d`` when its box is
    ``torch.chunk`` part ``t.rank`` of its tensor along ``d`` (``split.chunk_dims``), else -1."""
    return chunk_dims(t.shape, t.offsets, t.lengths, t.rank, world)


@dataclass(eq=False)
class RankGroup:
    """Ranks whose tables are alike up to their rank (``ranks``, ascending), one of their tables
    (the first rank's) and its chunk rule (per row: the dimension, or -1 for an explicit box)."""

    table: ShardTable
    rule: np.ndarray
    ranks: list[int]


def group_ranks(
    sources: Sequence[LocalSavePlan | ShardTable], unsplit: Collection[str] = ()
) -> tuple[list[RankGroup], np.ndarray, list[tuple[BlobSpec, ...]]]:
    """The ranks' groups (in the order of their first ranks), each rank's group and each rank's
    blobs (a rank's own: not part of its template). The rows of the tensors in ``unsplit`` are
    explicit boxes whatever the chunk rule says. ``PlanningError`` if the plans are not ranks
    0..world-1 in order."""
    world = len(sources)
    found: dict[tuple, int] = {}
    groups: list[RankGroup] = []
    of_rank = np.empty(world, dtype=np.int64)
    blobs: list[tuple[BlobSpec, ...]] = []
    for r in range(world):
        source = sources[r]  # one rank's table at a time (wire.LocalPlans decodes it now)
        t = source if isinstance(source, ShardTable) else ShardTable.of(source)
        if t.rank != r:
            raise PlanningError("local plans must come from ranks 0..world_size-1 in order")
        rule = chunk_rule(t, world)
        if unsplit:
            rule[np.isin(t.name, [i for i, n in enumerate(t.names) if n in unsplit])] = -1
        explicit = rule < 0
        key = (  # the arrays' lengths fix where each starts in the joined bytes
            t.names,
            t.dtypes,
            t.shape.shape,
            int(explicit.sum()),
            b"".join(
                a.tobytes()
                for a in (t.name, t.dtype, t.ndim, t.source, t.shape, rule, t.offsets[explicit], t.lengths[explicit])
            ),
        )
        at = found.get(key)
        if at is None:
            at = found[key] = len(groups)
            groups.append(RankGroup(t, rule, []))
        groups[at].ranks.append(r)
        of_rank[r] = at
        blobs.append(t.blobs)
    return groups, of_rank, blobs


@dataclass(frozen=True, eq=False)
class SplitTensors:
    """The split tensors laid out alike in every rank's files (job tensor order): per tensor its
    dimension, extent along it, chunk rows, bytes per row and file part; ``item``: per group,
    each tensor's row (-1: none); ``override``: per rank, (tensors, rows) where the rank's row
    is not its group's (a tensor whose chunks are written from explicit boxes); ``members``:
    each file part's tensors (indices, byte order)."""

    fqns: list[str]
    dims: np.ndarray
    extent: np.ndarray
    chunk: np.ndarray
    row_bytes: np.ndarray
    part: np.ndarray
    item: np.ndarray  # (groups, tensors)
    override: dict[int, tuple[np.ndarray, np.ndarray]]
    members: dict[int, np.ndarray]

    def rows_of(self, rank: int | np.ndarray) -> np.ndarray:
        """Rows of each split tensor's chunk at ``rank`` (0: an empty chunk); for a column of
        ranks, one row of the result per rank."""
        lo = np.minimum(self.extent, rank * self.chunk)
        return np.minimum(self.extent, lo + self.chunk) - lo

    def items_of(self, rank: int, group: int) -> np.ndarray:
        """Rank ``rank``'s row of each split tensor (-1: none)."""
        items = self.item[group]
        if rank in self.override:
            items = items.copy()
            js, rows = self.override[rank]
            items[js] = rows
        return items


class RegularRankPlans(Sequence[RankSavePlan]):
    """Every rank's ``RankSavePlan``, computed when asked (one rank's entries cost O(its
    entries); none is kept). ``explicit``: per rank, its entries outside the split tensors,
    placed once for the whole job: rows (item or -1, file part, offset, nbytes, blob index or
    -1) grouped by part, and its blob keys; ``parts``: per rank, the file parts it writes, in
    order."""

    def __init__(
        self,
        save_id: str,
        world: int,
        split: SplitTensors,
        template_of: np.ndarray,
        explicit: dict[int, tuple[np.ndarray, list[str]]],
        parts: list[tuple[int, ...]],
    ) -> None:
        self.save_id = save_id
        self.world = world
        self.split = split
        self.template_of = template_of
        self.explicit = explicit
        self.parts = parts

    def __len__(self) -> int:
        return self.world

    def __getitem__(self, rank):  # type: ignore[override]
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(self.world))]
        if not -self.world <= rank < self.world:
            raise IndexError(rank)
        rank %= self.world
        files, rows, blobs = self.rank_rows(rank)
        entries = tuple(
            WriteEntry(item, files[f], off, n, blobs[b] if b >= 0 else "") for item, f, off, n, b in rows.tolist()
        )
        return RankSavePlan(rank, self.save_id, entries)

    def __iter__(self) -> Iterator[RankSavePlan]:
        return (self[r] for r in range(self.world))

    def __eq__(self, other: object) -> bool:  # as the tuple of its plans (tests; O(the job))
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(other) == self.world and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def with_save_id(self, save_id: str) -> RegularRankPlans:
        return RegularRankPlans(save_id, self.world, self.split, self.template_of, self.explicit, self.parts)

    def files_of(self, rank: int) -> list[str]:
        return [file_name(rank, k) for k in self.parts[rank]]

    def rank_rows(self, rank: int) -> tuple[list[str], np.ndarray, list[str]]:
        """Rank ``rank``'s entries as columns: its files, one row per entry (item index, file
        index, byte offset, byte length, blob index or -1) grouped by file in byte order, and
        its blob keys."""
        s = self.split
        nbytes = s.rows_of(rank) * s.row_bytes
        items = s.items_of(rank, int(self.template_of[rank]))
        local = np.full(len(s.members), -1, dtype=np.int64)
        local[list(self.parts[rank])] = np.arange(len(self.parts[rank]))
        at = np.flatnonzero(nbytes > 0)  # empty chunks take no bytes and get no entry
        at = at[np.argsort(s.part[at], kind="stable")]  # by part, each part's in the tensor order
        chunk_part = s.part[at]
        chunks = np.empty((len(at), 5), dtype=np.int64)
        chunks[:, 0], chunks[:, 1], chunks[:, 3], chunks[:, 4] = items[at], chunk_part, nbytes[at], -1
        chunks[:, 2] = stack(chunk_part, nbytes[at], np.zeros(len(s.members), dtype=np.int64))
        more, blobs = self.explicit.get(rank, (np.zeros((0, 5), dtype=np.int64), []))
        both = np.concatenate([chunks, more])
        rows = both[np.argsort(both[:, 1], kind="stable")]  # by part: its chunks, then its other entries
        rows[:, 1] = local[rows[:, 1]]
        return self.files_of(rank), rows, list(blobs)

    def explicit_entries(self) -> Iterator[tuple[int, WriteEntry]]:
        """Every rank's entries outside the split tensors (the boxes the metadata lists as rows,
        and the blobs), with the rank writing each."""
        for rank in sorted(self.explicit):
            rows, blobs = self.explicit[rank]
            for item, k, off, n, b in rows.tolist():
                yield rank, WriteEntry(item, file_name(rank, k), off, n, blobs[b] if b >= 0 else "")

    def file_ends(self) -> dict[str, tuple[int, int]]:
        """Each data file's size as planned, and the rank writing it."""
        out = {}
        for rank in range(self.world):
            files, rows, _ = self.rank_rows(rank)
            if not len(rows):
                continue
            end = np.zeros(len(files), dtype=np.int64)
            np.maximum.at(end, rows[:, 1], rows[:, 2] + rows[:, 3])
            for name, size in zip(files, end.tolist()):
                out[name] = (size, rank)
        return out
