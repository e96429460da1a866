"""Every rank group's table as one set of columns (pure functions): the save planner's rows.

A rank group is ranks whose tables are alike up to their ``torch.chunk`` rows
(``templates.group_ranks``; one group per rank in an irregular job); ``plan.plan_save`` passes
one table per group.
``JobRows.of`` concatenates the tables (rows in group order, then spec order; names and dtypes as
job-wide ids), refuses sizes near int64's limits (a tensor of 2^55 elements, ``MAX_TOTAL`` bytes,
``MAX_BLOB``-byte blobs: no machine holds them) and computes each box's bytes and whether it is
kept (an empty shard of a tensor with elements is not). The planner then checks the ranks agree
(``disagreements``, worded rank by rank), chooses writers over these rows (``writers.choose_writers``), checks the
written boxes tile their tensors (``tiling_problems``) and builds the plan's records sharing one
tuple per distinct box (``tuples``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ...errors import PlanningError
from ...format.dtypes import itemsize
from ...format.validation import box_coverage_problem
from ..specs import Shape
from .table import ShardTable

__all__ = ["JobRows", "tiling_problems", "tuples", "MAX_BLOB", "MAX_TOTAL"]

MAX_BLOB = 1 << 56
MAX_TOTAL = 1 << 61  # byte offsets stay far inside int64
_MAX_NUMEL_LOG2 = 55  # a tensor's elements (times an item size) far inside int64


@dataclass(frozen=True, eq=False)
class JobRows:
    """Every group's table concatenated (rows in group order, then spec order; ``rank``: the
    rank of the table each row comes from), names and dtypes as job-wide ids; ``first``: each
    row's tensor's first row; ``nbytes`` of each box; ``kept``: rows not skipped as empty
    shards."""

    names: list[str]
    dtypes: list[str]
    rank: np.ndarray
    index: np.ndarray
    name: np.ndarray
    dtype: np.ndarray
    ndim: np.ndarray
    source: np.ndarray
    shape: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    first: np.ndarray
    nbytes: np.ndarray
    kept: np.ndarray  # rows not skipped as empty shards

    @classmethod
    def of(cls, tables: list[ShardTable]) -> JobRows:
        names: dict[str, int] = {}
        dtypes: dict[str, int] = {}
        width = max([1, *(t.shape.shape[1] for t in tables)])  # >= 1: a padded full dim of 1 for 0-d jobs
        cols: dict[str, list[np.ndarray]] = defaultdict(list)
        seen: tuple[str, ...] | None = None
        name_ids = np.zeros(0, dtype=np.int64)
        for t in tables:
            if t.names != seen:  # ranks of one job usually list the same names in the same order
                name_ids = np.array([names.setdefault(x, len(names)) for x in t.names], dtype=np.int64)
                seen = t.names
            dtype_ids = np.array([dtypes.setdefault(x, len(dtypes)) for x in t.dtypes], dtype=np.int64)
            n, w = t.shape.shape
            cols["rank"].append(np.full(n, t.rank, dtype=np.int64))
            cols["index"].append(np.arange(n, dtype=np.int64))
            cols["name"].append(name_ids[t.name] if n else np.zeros(0, dtype=np.int64))
            cols["dtype"].append(dtype_ids[t.dtype] if n else np.zeros(0, dtype=np.int64))
            cols["ndim"].append(t.ndim)
            cols["source"].append(t.source)
            for key, pad, a in (("shape", 1, t.shape), ("offsets", 0, t.offsets), ("lengths", 1, t.lengths)):
                cols[key].append(np.pad(a, ((0, 0), (0, width - w)), constant_values=pad) if w < width else a)
        c = {k: np.concatenate(v) for k, v in cols.items()}
        for k in ("rank", "index", "name", "dtype", "ndim", "source", "shape", "offsets", "lengths"):  # no ranks
            c.setdefault(k, np.zeros((0, width) if k in ("shape", "offsets", "lengths") else 0, dtype=np.int64))
        sizes = np.array([itemsize(d) for d in dtypes], dtype=np.int64)  # CorruptMetadataError: unknown
        huge = np.log2(np.maximum(c["shape"], 1)).sum(axis=1) > _MAX_NUMEL_LOG2
        if huge.any():
            r = int(np.flatnonzero(huge)[0])
            nd = int(c["ndim"][r])
            raise PlanningError(
                f"{list(names)[int(c['name'][r])]}: global shape {tuple(c['shape'][r, :nd].tolist())} has more than "
                f"2^{_MAX_NUMEL_LOG2} elements"
            )
        tensor_numel = np.prod(c["shape"], axis=1)
        box_numel = np.prod(c["lengths"], axis=1)
        _, first, inverse = np.unique(c["name"], return_index=True, return_inverse=True)
        kept = ~((box_numel == 0) & (c["ndim"] > 0) & (tensor_numel != 0))
        return cls(
            list(names),
            list(dtypes),
            **c,
            first=first[inverse.reshape(-1)],
            nbytes=box_numel * sizes[c["dtype"]],
            kept=kept,
        )

    def disagreements(self, group_ranks: list[np.ndarray] | None = None, group: np.ndarray | None = None) -> list[str]:
        """Every row whose dtype or global shape differs from its tensor's first row, once per
        rank holding it (``group_ranks``: each group's ranks, ``group``: each row's; None: a row
        is its rank's), in rank order, then spec order."""
        f = self.first
        bad = np.flatnonzero(
            (self.dtype != self.dtype[f]) | (self.ndim != self.ndim[f]) | (self.shape != self.shape[f]).any(axis=1)
        )
        if group_ranks is None or group is None:
            held = [(int(self.rank[r]), int(self.index[r]), r) for r in bad.tolist()]
        else:
            held = sorted((q, int(self.index[r]), r) for r in bad.tolist() for q in group_ranks[int(group[r])].tolist())
        out = []
        for rank, _, r in held:
            g = int(f[r])
            fqn = self.names[int(self.name[r])]
            mine, seen = self.dtypes[int(self.dtype[r])], self.dtypes[int(self.dtype[g])]
            out.append(
                f"{fqn}: rank {rank} has dtype {mine} shape {self._shape(r)}, "
                f"another rank has dtype {seen} shape {self._shape(g)}"
            )
        return out

    def _shape(self, r: int) -> Shape:
        return tuple(self.shape[r, : int(self.ndim[r])].tolist())

    def box(self, r: int) -> tuple[str, Shape, Shape]:
        nd = int(self.ndim[r])
        return (
            self.names[int(self.name[r])],
            tuple(int(v) for v in self.offsets[r, :nd]),
            tuple(int(v) for v in self.lengths[r, :nd]),
        )

    def tensors(self) -> dict[str, tuple[str, Shape]]:
        """fqn -> (dtype, global shape), in the order the rows first name them."""
        firsts = np.unique(self.first)
        names, dtypes = self.names, self.dtypes
        return dict(
            zip(
                [names[g] for g in self.name[firsts].tolist()],
                zip([dtypes[d] for d in self.dtype[firsts].tolist()], tuples(self.shape[firsts], self.ndim[firsts])),
            )
        )


def tiling_problems(
    rows: JobRows, chosen: np.ndarray, record_order: np.ndarray, among: np.ndarray | None = None
) -> list[str]:
    """Where the chosen boxes do not tile a tensor of any elements, in the tensors' order
    (``fqn: problem``, the boxes given to ``box_coverage_problem`` in the record order). Boxes
    that split a tensor along one dimension are checked on columns; the others, and tensors
    nobody writes, by ``box_coverage_problem``."""
    names = rows.name[chosen]
    full = rows.shape[chosen]
    offs, lens = rows.offsets[chosen], rows.lengths[chosen]
    cut = (offs != 0) | (lens != full)
    ncut = cut.sum(axis=1)
    dim = np.where(ncut == 1, cut.argmax(axis=1), -1)
    space = len(rows.names)
    split = np.full(space, -1, dtype=np.int64)
    np.maximum.at(split, names, dim)
    boxes = np.bincount(names, minlength=space)
    odd = np.zeros(space, dtype=bool)
    odd[names[(ncut > 1) | (dim != split[names])]] = True
    odd |= (split == -1) & (boxes != 1)
    along = split[names] >= 0
    d = np.maximum(split[names], 0)
    start = np.take_along_axis(offs, d[:, None], axis=1)[:, 0]
    end = start + np.take_along_axis(lens, d[:, None], axis=1)[:, 0]
    size = np.take_along_axis(full, d[:, None], axis=1)[:, 0]
    o = np.lexsort((start, names))
    g, st, en, sz = names[o], start[o], end[o], size[o]
    first = np.concatenate([[True], g[1:] != g[:-1]])
    last = np.concatenate([g[1:] != g[:-1], [True]])
    prev_end = np.concatenate([[0], en[:-1]])
    gap = np.where(first, st != 0, st != prev_end) | (last & (en != sz))
    odd[g[gap & along[o]]] = True
    firsts = np.unique(rows.first)  # each tensor's first row: the tensors' order
    tensor_names = rows.name[firsts]
    live = np.prod(rows.shape[firsts], axis=1) != 0
    check = np.zeros(space, dtype=bool)
    check[tensor_names[live]] = True  # names a table lists but no row uses are no tensors
    check &= odd | (boxes == 0)
    if among is not None:  # only these tensors (per name id)
        check &= among
    if not check.any():
        return []
    by_record = np.lexsort((record_order, names))  # by tensor, each tensor's boxes in the record order
    sorted_names = names[by_record]
    problems = []
    for t, r0 in zip(tensor_names.tolist(), firsts.tolist()):
        if not check[t]:
            continue
        a, b = np.searchsorted(sorted_names, [t, t + 1]).tolist()
        nd = int(rows.ndim[r0])
        shape = tuple(rows.shape[r0, :nd].tolist())
        written = chosen[by_record[a:b]].tolist()
        tiles = [(tuple(rows.offsets[r, :nd].tolist()), tuple(rows.lengths[r, :nd].tolist())) for r in written]
        problem = box_coverage_problem(shape, tiles)
        if problem is not None:
            problems.append(f"{rows.names[t]}: {problem}")
    return problems


def tuples(values: np.ndarray, ndim: np.ndarray) -> list[tuple[int, ...]]:
    """Each row's first ``ndim`` values as a tuple of Python ints; rows that are alike share
    one tuple (a job's boxes repeat a few patterns: one tuple per pattern, not per row)."""
    if len(values) == 0:
        return []
    table = np.column_stack([ndim, values])
    key = np.zeros(len(table), dtype=np.int64)
    radix = 1
    for column in table.T:  # one integer per row pattern: mixed radix of the columns' codes
        codes, code = np.unique(column, return_inverse=True)
        if radix * len(codes) >= 1 << 62:
            return [tuple(row[1 : 1 + row[0]]) for row in table.tolist()]  # too many patterns
        key += code.reshape(-1) * radix
        radix *= len(codes)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    made = [tuple(row[1 : 1 + row[0]]) for row in table[first].tolist()]
    return [made[i] for i in inverse.reshape(-1).tolist()]
