"""The save planner of regular jobs: a global plan that grows with the tensors, not with the
ranks, where ranks fall into few templates: every rank holds ``torch.chunk`` part r of the split
tensors (FSDP's ``Shard(0)`` over the whole job, ZeRO-3) and rank-independent boxes of the rest
(replicated 0-d optimizer steps, buffers, DDP's whole tensors), or few ranks differ.

The first planner ``plan.plan_save`` tries on the coordinator, before the column planner. It reads
the ranks' local plans one at a time (bytes are decoded here and dropped: the coordinator never
holds every rank's table at once) and reduces each to a *template*: its rows with the split rows'
boxes replaced by their rule ("chunk of rank r along dimension d", ``chunk_rule``). Ranks of one
template differ only by their rank: an FSDP job of 4,096 ranks is one template. It then plans on
the templates' tables as one set of rows (``rows.JobRows``: the ranks agree, sizes in bounds):
1. split tensors: every template holds exactly one rule row of the tensor along the same
   dimension (or, for templates whose ranks all fall past the last non-empty chunk, none);
   they are written by their ranks and laid out as ``split`` lays them out. Where that would
   leave a rank without a file a layout names (``split.RankWithoutFile``), ``plan_regular``
   plans again with only the tensors whose every chunk has rows as split, then with none
   (``_SPLIT_ATTEMPTS``: the column planner's retry). A tensor with chunk rows that the column
   planner would not split either (no elements, or another rank's box that is no rank's chunk:
   ``_never_a_chunk``) is planned with its chunk rows as explicit boxes (``_Demoted``: the
   templates are taken again);
2. the other (explicit) boxes are deduplicated across templates; a box's holders are the ranks
   of the templates holding it; each is written by its only holder, the replica source a holder
   names, else worst-fit (largest first to the holder with the fewest bytes, split chunks
   counted): ``writers.choose_writers`` over the templates, the column planner's rule; the
   written boxes tile their tensors (``rows.tiling_problems``);
3. byte layout: each rank's chunks first (``SplitLayout``'s offsets), then its explicit boxes
   and blobs, largest first to the lightest file: ``layout.lay_out_rank``'s two steps, its
   other entries placed at plan time (``place_rest``), its chunks when its plan is asked for
   (``stack``).
The result is a ``GlobalSavePlan`` whose ``rank_plans`` is a ``RegularRankPlans``: a rank's
entries are computed when asked (``plan_stage`` encodes each rank's part from its columns,
``rank_rows``), never held for every rank. Anything else (ranks disagreeing, a tensor split over
part of the job or with chunk rows the column planner might split, too many templates, a tiling
problem, absurd sizes) raises ``NotRegular`` saying why, and the column planner plans it or
raises its precise error. The plans are equal (tests/unit/planning/test_save_planner.py).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import CorruptMetadataError, InternalError, PlanningError
from ...format.dtypes import itemsize
from ..specs import BlobSpec, Shape
from .layout import lay_out_rank, padded, place_rest, stack
from .model import GlobalSavePlan, LocalSavePlan, RankSavePlan, WriteEntry, file_name
from .rows import MAX_BLOB, MAX_TOTAL, JobRows, tiling_problems
from .split import RankWithoutFile, chunk_dims, split_parts
from .table import ShardTable
from .writers import choose_writers

__all__ = ["plan_regular", "chunk_rule", "RegularRankPlans", "NotRegular", "MAX_TEMPLATES"]


class NotRegular(Exception):
    """The job is not one the templates plan (its message says why); ``plan.plan_save`` then
    plans it on columns, which plan every job or raise the ``PlanningError`` naming its problem.
    Never leaves the planner."""


# beyond this many distinct templates a job is not regular enough to gain (the column planner)
MAX_TEMPLATES = 64


def chunk_rule(t: ShardTable, world: int) -> np.ndarray:
    """Per row of ``t`` (rank ``t.rank`` of ``world``): the dimension ``d`` when its box is
    ``torch.chunk`` part ``t.rank`` of its tensor along ``d`` (``split.chunk_dims``), else -1."""
    return chunk_dims(t.shape, t.offsets, t.lengths, t.rank, world)


@dataclass(eq=False)
class _Template:
    """Ranks whose tables are alike up to their rank (``ranks``), and one of their tables."""

    table: ShardTable
    rule: np.ndarray
    ranks: list[int]


def _templates(
    sources: Sequence[LocalSavePlan | ShardTable],
    split: str = "all",
    unsplit: Collection[str] = (),
) -> tuple[list[_Template], list[int], list[tuple[BlobSpec, ...]]]:
    """The ranks' templates, each rank's template and each rank's blobs (a rank's own: not part
    of its template); ``NotRegular`` when there are too many. ``split``: which rule rows count
    (``_SPLIT_ATTEMPTS``); the others' boxes, and those of the tensors in ``unsplit``, are
    explicit."""
    world = len(sources)
    found: dict[tuple, int] = {}
    templates: list[_Template] = []
    of_rank: list[int] = []
    blobs: list[tuple[BlobSpec, ...]] = []
    for r in range(world):
        source = sources[r]  # one rank's table at a time (wire.LocalPlans decodes it now)
        t = source if isinstance(source, ShardTable) else ShardTable.of(source)
        if t.rank != r:
            raise NotRegular("local plans out of rank order")  # plan_save's own check raises
        rule = chunk_rule(t, world)
        if split == "full":
            rule = _full_only(rule, t.shape, world)
        elif split == "none":
            rule = np.full(len(rule), -1, dtype=np.int64)
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
            if len(templates) == MAX_TEMPLATES:
                raise NotRegular(f"more than {MAX_TEMPLATES} templates")
            at = found[key] = len(templates)
            templates.append(_Template(t, rule, []))
        templates[at].ranks.append(r)
        of_rank.append(at)
        blobs.append(t.blobs)
    return templates, of_rank, blobs


def _full_only(rule: np.ndarray, shape: np.ndarray, world: int) -> np.ndarray:
    """``rule`` (per row: its chunk dimension or -1) kept only for rows of tensors cut into
    ``world`` non-empty chunks along it."""
    extent = np.take_along_axis(shape, np.maximum(rule, 0)[:, None], axis=1)[:, 0]
    size = -(-extent // world)
    return np.where((rule >= 0) & (-(-extent // np.maximum(size, 1)) == world), rule, -1)


class _Demoted(Exception):
    """Tensors with chunk rows that are not split (``fqns``): ``plan_regular`` takes the
    templates again with their rows as explicit boxes."""

    def __init__(self, fqns: list[str]) -> None:
        super().__init__(fqns)
        self.fqns = fqns


def _never_a_chunk(rows: JobRows, at: np.ndarray, world: int) -> np.ndarray:
    """Per row ``at`` of ``rows``: whether its box is ``torch.chunk`` part q of its tensor for
    no rank q along no dimension (then whoever writes it, the column planner does not split
    its tensor: ``split.split_dims``)."""
    shape, offsets, lengths = rows.shape[at], rows.offsets[at], rows.lengths[at]
    some = np.zeros(len(at), dtype=bool)
    for d in range(shape.shape[1]):
        size = np.maximum(-(-shape[:, d] // world), 1)
        q = np.minimum(offsets[:, d] // size, world - 1)
        some |= chunk_dims(shape, offsets, lengths, q, world) == d
    return ~some


@dataclass(frozen=True, eq=False)
class _Split:
    """The split tensors (job tensor order): per tensor its dimension, extent along it, chunk
    rows, bytes per row and file part; ``item``: per template, each tensor's row (-1: none);
    ``members``: each file part's tensors."""

    fqns: list[str]
    dims: np.ndarray
    extent: np.ndarray
    chunk: np.ndarray
    row_bytes: np.ndarray
    part: np.ndarray
    item: np.ndarray  # (templates, tensors)
    members: dict[int, np.ndarray]  # each part's tensors (indices, byte order)

    def rows_of(self, rank: int | np.ndarray) -> np.ndarray:
        """Rows of each split tensor's chunk at ``rank`` (0: an empty chunk); for a column of
        ranks, one row of the result per rank."""
        lo = np.minimum(self.extent, rank * self.chunk)
        return np.minimum(self.extent, lo + self.chunk) - lo


class RegularRankPlans(Sequence[RankSavePlan]):
    """Every rank's ``RankSavePlan`` of a regular job, computed when asked (one rank's entries
    cost O(its entries); none is kept). ``explicit``: per rank, its entries outside the split
    tensors, placed (file part, offset) once for the whole job; ``parts``: per rank, the file
    parts it writes, in order."""

    def __init__(
        self,
        save_id: str,
        world: int,
        split: _Split,
        template_of: np.ndarray,
        explicit: dict[int, list[tuple[int, int, int, int, str]]],
        parts: list[tuple[int, ...]],
    ) -> None:
        self.save_id = save_id
        self.world = world
        self.split = split
        self.template_of = template_of
        self.explicit = explicit  # rank -> [(part, offset, nbytes, item, blob key)]
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
        items = s.item[self.template_of[rank]]
        local = np.full(len(s.members), -1, dtype=np.int64)
        local[list(self.parts[rank])] = np.arange(len(self.parts[rank]))
        at = np.flatnonzero(nbytes > 0)  # empty chunks take no bytes and get no entry
        at = at[np.argsort(s.part[at], kind="stable")]  # by part, each part's in the tensor order
        chunk_part = s.part[at]
        chunks = np.empty((len(at), 5), dtype=np.int64)
        chunks[:, 0], chunks[:, 1], chunks[:, 3], chunks[:, 4] = items[at], chunk_part, nbytes[at], -1
        chunks[:, 2] = stack(chunk_part, nbytes[at], np.zeros(len(s.members), dtype=np.int64))
        extra = self.explicit.get(rank, [])
        blobs = [key for *_, key in extra if key]
        more = np.empty((len(extra), 5), dtype=np.int64)
        b = 0
        for i, (k, off, n, item, key) in enumerate(extra):
            more[i] = (item, k, off, n, b if key else -1)
            b += bool(key)
        both = np.concatenate([chunks, more])
        rows = both[np.argsort(both[:, 1], kind="stable")]  # by part: its chunks, then its other entries
        rows[:, 1] = local[rows[:, 1]]
        return self.files_of(rank), rows, blobs

    def explicit_entries(self) -> Iterator[tuple[int, WriteEntry]]:
        """Every rank's entries outside the split tensors (the boxes the metadata lists as rows,
        and the blobs), with the rank writing each."""
        for rank in sorted(self.explicit):
            for k, off, n, item, key in self.explicit[rank]:
                yield rank, WriteEntry(item, file_name(rank, k), off, n, key)

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


def plan_regular(sources: Sequence[LocalSavePlan | ShardTable], save_id: str, files_per_rank: int) -> GlobalSavePlan:
    """The global plan of a regular job (module docstring); ``NotRegular`` for any other job
    (the column planner's)."""
    world = len(sources)
    if world < 1:
        raise NotRegular("no ranks")
    unsplit: set[str] = set()  # tensors whose chunk rows are planned as explicit boxes
    for split in _SPLIT_ATTEMPTS:
        while True:
            templates, of_rank, blobs = _templates(sources, split, unsplit)
            try:
                args = (templates, np.array(of_rank, dtype=np.int64), blobs, world, save_id, max(1, files_per_rank))
                return _plan(*args)
            except _Demoted as e:  # again, with their chunk rows as explicit boxes
                unsplit.update(e.fqns)
            except RankWithoutFile:  # a rank would lack a file a layout names: fewer split tensors
                break
    raise InternalError("a save plan without split tensors left a rank without a layout file")


# the split tensors ``plan_regular`` tries, in turn, as the column planner (``split``'s retry): every
# tensor the chunk rule finds, only those whose every chunk has rows (``split.full_chunks``), none
_SPLIT_ATTEMPTS = ("all", "full", "none")


def _plan(
    templates: list[_Template],
    template_of: np.ndarray,
    blobs: list[tuple[BlobSpec, ...]],
    world: int,
    save_id: str,
    parts: int,
) -> GlobalSavePlan:
    # the templates' tables as one set of rows (rows.JobRows: templates by first rank, rows in order)
    try:
        rows = JobRows.of([tm.table for tm in templates])
    except (CorruptMetadataError, PlanningError):
        raise NotRegular("an unknown dtype, or a tensor past the size limits") from None  # the column planner's
    if rows.disagreements():
        raise NotRegular("ranks disagree on a tensor")  # the column planner names them
    tensors = rows.tensors()
    sizes = {fqn: itemsize(dtype) for fqn, (dtype, _) in tensors.items()}
    group = np.repeat(np.arange(len(templates), dtype=np.int64), [len(tm.table) for tm in templates])
    rule = np.concatenate([tm.rule for tm in templates]) if templates else np.zeros(0, dtype=np.int64)
    rows_by_tensor: dict[int, list[int]] = {int(g): [] for g in rows.name[np.unique(rows.first)].tolist()}
    for r, g in enumerate(rows.name.tolist()):
        rows_by_tensor[g].append(r)
    groups, index = group.tolist(), rows.index.tolist()

    # 1. split tensors
    split_fqns: list[str] = []
    split_dim: list[int] = []
    split_rows: list[dict[int, int]] = []
    explicit: list[int] = []  # the rows of tensors outside the split ones
    demoted: list[str] = []  # tensors with chunk rows that are not split
    for g, held in rows_by_tensor.items():
        fqn = rows.names[g]
        ruled = [r for r in held if rule[r] >= 0]
        shape = tensors[fqn][1]
        if not ruled:
            explicit.extend(held)
            continue
        if math.prod(shape) == 0 or len(ruled) != len(held):
            others = np.array([r for r in held if rule[r] < 0 and rows.kept[r]], dtype=np.int64)
            if math.prod(shape) == 0 or _never_a_chunk(rows, others, world).any():
                demoted.append(fqn)  # the column planner does not split it either: its boxes are explicit
                continue
            raise NotRegular(f"{fqn}: chunks on some ranks, other boxes on others")
        seen = {int(rule[r]) for r in ruled}
        per_template = [groups[r] for r in ruled]
        if len(seen) != 1 or len(set(per_template)) != len(per_template):
            raise NotRegular(f"{fqn}: split along several dimensions, or twice on a rank")
        d = seen.pop()
        size = -(-shape[d] // world)
        chunks = -(-shape[d] // size)  # the non-empty chunks: ranks 0 .. chunks - 1
        held_by = set(per_template)
        for ti, tm in enumerate(templates):
            if ti not in held_by and tm.ranks[0] < chunks:
                raise NotRegular(f"{fqn}: split over part of the job")  # a rank with a non-empty chunk does not hold it
        split_fqns.append(fqn)
        split_dim.append(d)
        split_rows.append({groups[r]: index[r] for r in ruled})
    if demoted:
        raise _Demoted(demoted)
    dims = np.array(split_dim, dtype=np.int64)
    extent = np.array([tensors[f][1][d] for f, d in zip(split_fqns, split_dim)], dtype=np.int64)
    chunk = -(-extent // world)
    row_bytes = np.array(
        [math.prod(tensors[f][1]) // tensors[f][1][d] * sizes[f] for f, d in zip(split_fqns, split_dim)], dtype=np.int64
    )
    item = np.full((len(templates), len(split_fqns)), -1, dtype=np.int64)
    for j, rows_of in enumerate(split_rows):
        for ti, i in rows_of.items():
            item[ti, j] = i
    # parts: largest chunk 0 first to the part with the fewest bytes (split.split_parts)
    by_part = split_parts(list(range(len(split_fqns))), (chunk * row_bytes).tolist(), parts)
    part = np.array(list(by_part.values()), dtype=np.int64)
    members = {k: np.flatnonzero(part == k) for k in range(parts)}
    split = _Split(split_fqns, dims, extent, chunk, row_bytes, part, item, members)

    # each rank's split bytes per part: raw (what parts are balanced by) and aligned (offsets)
    raw = split.rows_of(np.arange(world, dtype=np.int64)[:, None]) * row_bytes  # (world, tensors)
    if float(raw.sum(dtype=np.float64)) > MAX_TOTAL:
        raise NotRegular("more than 2^61 bytes")
    loads_by_part = np.zeros((world, parts), dtype=np.int64)
    ends_by_part = np.zeros((world, parts), dtype=np.int64)
    uses = np.zeros((world, parts), dtype=bool)
    for k, at in members.items():
        loads_by_part[:, k] = raw[:, at].sum(axis=1)
        ends_by_part[:, k] = padded(raw[:, at]).sum(axis=1)
        uses[:, k] = (raw[:, at] > 0).any(axis=1)
    del raw

    # 2. explicit boxes: holders, then writers
    ranks_of = [np.array(tm.ranks, dtype=np.int64) for tm in templates]
    writers = _choose(rows, group, np.array(sorted(explicit), dtype=np.int64), ranks_of, template_of, loads_by_part)

    # 3. each rank's explicit entries and blobs, largest first to the lightest part
    work: dict[int, list[tuple[int, bool, int, str]]] = {}  # rank -> [(nbytes, is a blob, item, key)]
    for fqn, _, lens, rank, idx in writers:
        work.setdefault(rank, []).append((math.prod(lens) * sizes[fqn], False, idx, ""))
    for rank, own in enumerate(blobs):
        for b in own:
            if not 0 <= b.nbytes <= MAX_BLOB:
                raise NotRegular(f"blob {b.key!r}: absurd size")  # the column planner refuses it
            work.setdefault(rank, []).append((b.nbytes, True, 0, b.key))
    placed: dict[int, list[tuple[int, int, int, int, str]]] = {}
    for rank, items in work.items():
        ties = [w[1:] for w in items]
        tie = np.empty(len(items), dtype=np.int64)
        tie[sorted(range(len(items)), key=ties.__getitem__)] = np.arange(len(items))
        sizes_of = np.array([w[0] for w in items], dtype=np.int64)
        if split_fqns:
            order, at_part, at = place_rest(sizes_of, tie, loads_by_part[rank], ends_by_part[rank])
        else:  # boxes by item, then blobs in their order (rank r's work list), as the column planner
            order, at_part, at = lay_out_rank(sizes_of, parts)
        out = [
            (k, off, items[i][0], -1 if items[i][3] else items[i][2], items[i][3])
            for i, k, off in zip(order.tolist(), at_part.tolist(), at.tolist())
        ]
        uses[rank, at_part] = True
        placed[rank] = sorted(out, key=lambda e: e[0])  # by part, each part's in placement order
    used = sorted(set(part.tolist()))
    if not uses[:, used].all():
        raise RankWithoutFile  # plan_regular retries with fewer split tensors
    rank_parts = [tuple(np.flatnonzero(u).tolist()) for u in uses]
    files = tuple(file_name(r, k) for r in range(world) for k in rank_parts[r])
    index = {f: i for i, f in enumerate(files)}
    layouts = tuple(
        (
            tuple(index[file_name(r, k)] for r in range(world)),
            tuple((split_fqns[j], int(dims[j])) for j in np.flatnonzero(part == k).tolist()),
        )
        for k in used
    )
    plans = RegularRankPlans(save_id, world, split, template_of, placed, rank_parts)
    return GlobalSavePlan(save_id, plans, files, tensors, tuple(writers), layouts)


def _choose(
    rows: JobRows,
    group: np.ndarray,
    explicit: np.ndarray,
    ranks_of: list[np.ndarray],
    template_of: np.ndarray,
    loads_by_part: np.ndarray,
) -> list[tuple[str, Shape, Shape, int, int]]:
    """The writer of each explicit box (fqn, offsets, lengths, rank, row) in (rank, row) order:
    ``writers.choose_writers`` over the templates' ``explicit`` rows (ascending), every rank's
    split bytes counted (a rank holding a box twice is one holder of it); ``NotRegular`` for
    boxes that do not tile a tensor (``rows.tiling_problems``: the column planner then names
    the problem)."""
    ex = explicit[rows.kept[explicit]]  # empty shards: nothing to write
    chosen, ranks, record_order = choose_writers(
        rows.names,
        rows.name[ex],
        rows.offsets[ex],
        rows.lengths[ex],
        rows.nbytes[ex],
        rows.source[ex],
        group[ex],
        loads_by_part.sum(axis=1),
        ranks_of,
        template_of,
    )
    among = np.zeros(len(rows.names), dtype=bool)
    among[rows.name[explicit]] = True
    record_order = np.where(record_order < len(ex), ex[np.minimum(record_order, len(ex) - 1)], record_order)
    if tiling_problems(rows, ex[chosen], record_order, among):
        raise NotRegular("boxes that do not tile a tensor")  # the column planner names the problem
    at = ex[chosen]
    by = np.lexsort((rows.index[at], ranks))
    at, ranks = at[by], ranks[by]
    names, ndims = rows.names, rows.ndim[at].tolist()
    return [
        (names[g], tuple(o[:nd]), tuple(n[:nd]), rank, i)
        for g, o, n, nd, rank, i in zip(
            rows.name[at].tolist(),
            rows.offsets[at].tolist(),
            rows.lengths[at].tolist(),
            ndims,
            ranks.tolist(),
            rows.index[at].tolist(),
        )
    ]
