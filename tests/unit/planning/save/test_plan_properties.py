"""The save planner's properties (hypothesis), in one file: ``planning.save.plan.plan_save`` and
the column rules it is built from, each against an oracle of the test's own, each oracle
comparison made once.

- The reference planner (``tests.support.save_oracle``: one Python record per shard, split
  tensors laid out alike): every job of five families is planned exactly as the oracle plans it
  (the oracle computed once per job), or refused with exactly its error, from every form the
  planner is given (records, tables, tables decoded from the wire bytes, the coordinator's
  ``LocalPlans``), on rank groups (``templates.RegularRankPlans``) whose lazy parts give what
  the tuple gives; the plan satisfies the invariants the oracle states from the entries alone
  (``plan_problems``) and its ranks' loads are no worse than the oracle's by more than one record.
  Jobs past the documented size limits are refused alike from every form.
- Invariants computed here with numpy and torch (``support.boxes``), never with unickpt's own
  tiling check: deduplication, replica source, worst-fit balance, the byte layout (issue 11).
- The metadata (``format``): split tensors land where their layout says.
- The column rules against their plain loops: lightest-first against a heap, the rank layout
  against the record layout, ``chunk_rule`` against ``torch.chunk``, ``_chunk_sums`` against a
  per-rank loop.
"""

from __future__ import annotations

import heapq
import math
import re
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.boxes import element_size, numel, tiles_exactly
from tests.support.hypothesis_profiles import examples
from tests.support.save_oracle import assert_same_plan, outcome, plan_problems, plan_reference, rank_loads
from tests.support.save_oracle import layout as record_layout
from unickpt.errors import PlanningError
from unickpt.format import decode_metadata, encode_metadata
from unickpt.format.build import SaveSource, build_metadata
from unickpt.format.layouts import SplitShards
from unickpt.format.validation import validate_metadata
from unickpt.planning.save import GlobalSavePlan, LocalSavePlan, plan_save
from unickpt.planning.save.layout import _lightest_first, lay_out_rank
from unickpt.planning.save.model import file_name, rank_plan_rows
from unickpt.planning.save.plan import _chunk_sums
from unickpt.planning.save.table import ShardTable
from unickpt.planning.save.templates import RegularRankPlans, chunk_rule
from unickpt.planning.save.wire import (
    LocalPlans,
    decode_local_table,
    decode_rank_plan,
    encode_local_plan,
    encode_rank_rows,
)
from unickpt.planning.specs import BlobSpec, ShardSpec

SAVE_ID = "20250101T000000-0123456789ab"
DTYPES = ["float32", "bfloat16", "int64", "uint8", "float64"]
ALIGN = 64  # the documented entry alignment (planning.save.model: ENTRY_ALIGN)
# the planner's documented limits (planning/save/plan.py): no machine holds more
MAX_NUMEL, MAX_TOTAL, MAX_BLOB = 1 << 55, 1 << 61, 1 << 56


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """(first row, rows) of ``torch.chunk``'s part ``i`` of ``n`` rows into ``parts``."""
    c = -(-n // parts)
    lo = min(n, i * c)
    return lo, min(n, lo + c) - lo


def _box(shape: tuple[int, ...], d: int, lo: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(lo if i == d else 0 for i in range(len(shape))), tuple(n if i == d else s for i, s in enumerate(shape))


def _blocks(shape: tuple[int, ...], dim: int, cuts: list[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    bounds = [0, *cuts, shape[dim]]
    return [_box(shape, dim, a, b - a) for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------- the job families


@st.composite
def mixed_jobs(draw) -> tuple[list[LocalSavePlan], int]:
    """Every case the planner once left to a separate record planner: regular tensors (every
    rank one ``torch.chunk`` part), irregular blocks with replicas and named sources, replicated
    tensors and 0-d steps, a rank holding one box twice, ranks holding nothing, jobs of blobs
    only, large sizes (far inside int64: planned; past the documented limits: refused), and
    refusals (a block nobody holds, ranks disagreeing on a dtype)."""
    world = draw(st.integers(1, 6))
    specs: list[list[ShardSpec]] = [[] for _ in range(world)]
    kinds = ["chunk", "chunk", "blocks", "blocks", "replicated", "step", "twice", "rank0", "large", "gap", "disagree"]
    for t in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(kinds))
        fqn = f"model.t{t}"
        dtype = draw(st.sampled_from(["float32", "bfloat16", "int64", "uint8"]))
        shape: tuple[int, ...] = (draw(st.integers(1, 2 * world + 3)), draw(st.integers(1, 3)))
        source = draw(st.sampled_from([None, None, 0, world - 1]))
        if kind == "large":  # one huge dimension: near, or past, the planner's limits
            shape = (draw(st.sampled_from([1 << 20, 1 << 40, 1 << 54, 1 << 56])), 1)
            dtype = "uint8"
        d = draw(st.integers(0, 1))
        if kind in ("chunk", "large"):
            for r in range(world):
                lo, n = _chunk(shape[d], world, r)
                specs[r].append(ShardSpec(fqn, dtype, shape, *_box(shape, d, lo, n)))
        elif kind in ("blocks", "gap"):  # blocks along d, each held by some ranks (replicas); a gap: one missing
            cuts = sorted(draw(st.sets(st.integers(1, shape[d] - 1), max_size=3))) if shape[d] > 1 else []
            bounds = [0, *cuts, shape[d]]
            missing = draw(st.integers(0, len(bounds) - 2)) if kind == "gap" else -1
            for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
                if k == missing:
                    continue
                holders = draw(st.sets(st.integers(0, world - 1), min_size=1))
                for r in sorted(holders):
                    specs[r].append(ShardSpec(fqn, dtype, shape, *_box(shape, d, a, b - a), source))
        elif kind in ("replicated", "twice"):
            holders = sorted(draw(st.sets(st.integers(0, world - 1), min_size=1)))
            for r in holders:
                specs[r].append(ShardSpec(fqn, dtype, shape, (0, 0), shape, source))
            if kind == "twice":  # one rank holds the box twice
                specs[holders[0]].append(ShardSpec(fqn, dtype, shape, (0, 0), shape, source))
        elif kind == "step":
            for r in range(world):
                specs[r].append(ShardSpec(fqn, "float32", (), (), (), source))
        elif kind == "disagree":  # the last rank has another dtype
            for r in range(world):
                specs[r].append(ShardSpec(fqn, "int8" if r == world - 1 else dtype, shape, (0, 0), shape))
        else:  # rank 0 holds all of it, the others an empty box
            for r in range(world):
                specs[r].append(ShardSpec(fqn, dtype, shape, (0, 0), shape if r == 0 else (0, shape[1])))
    shuffle = draw(st.booleans())
    plans = []
    for r in range(world):
        shards = draw(st.permutations(specs[r])) if shuffle else specs[r]
        sizes = st.sampled_from([0, 7, 64, 300, 7, 64, MAX_BLOB + 1]) if draw(st.booleans()) else st.integers(0, 500)
        blobs = tuple(BlobSpec(f"loader/{r}/{i}", draw(sizes)) for i in range(draw(st.integers(0, 2))))
        plans.append(LocalSavePlan(r, tuple(shards), blobs))
    return plans, draw(st.integers(1, 3))


@st.composite
def column_jobs(draw, odd: bool = False) -> tuple[list[LocalSavePlan], int]:
    """0-d, 1-d, 2-d and 3-d tensors (some empty), each whole on every rank, split in blocks
    along one dimension (replicas, sources, empty boxes of uneven sharding), or (``odd``) split
    along two dimensions, held twice by one rank, disagreeing, or not tiled."""
    ws = draw(st.integers(1, 5))
    per_rank: list[list[ShardSpec]] = [[] for _ in range(ws)]
    for t in range(draw(st.integers(0, 5))):
        fqn = f"model.t{t}" if t % 2 else f"optimizer.state.t{t}.exp_avg"
        shape = tuple(draw(st.lists(st.integers(0 if odd else 1, 6), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES[:4]))
        kind = draw(
            st.sampled_from(
                ["whole", "split", "split", "grid", "twice", "gap", "disagree"] if odd else ["whole", "split"]
            )
        )
        if not shape or kind == "whole" or 0 in shape or max(shape) < 2:
            boxes = [((0,) * len(shape), shape)]
        elif kind == "grid" and len(shape) >= 2 and min(shape[:2]) >= 2:
            rows = _blocks(shape, 0, [draw(st.integers(1, shape[0] - 1))])
            boxes = []
            for o, n in rows:
                for o2, n2 in _blocks(n, 1, [draw(st.integers(1, shape[1] - 1))]):
                    boxes.append((tuple(a + b for a, b in zip(o, o2)), n2))
        else:
            dim = draw(st.sampled_from([d for d in range(len(shape)) if shape[d] >= 2]))
            cuts = sorted(draw(st.sets(st.integers(1, shape[dim] - 1), min_size=1, max_size=min(3, shape[dim] - 1))))
            boxes = _blocks(shape, dim, cuts)
            if kind == "gap" and len(boxes) > 1:
                boxes = boxes[1:]
        for b, (offs, lens) in enumerate(boxes):
            holders = sorted(draw(st.sets(st.integers(0, ws - 1), min_size=1, max_size=ws)))
            source = draw(st.sampled_from([None, None, holders[0], ws - 1]))
            for r in holders:
                per_rank[r].append(ShardSpec(fqn, dtype, shape, offs, lens, source))
                if kind == "twice" and b == 0 and r == holders[0]:
                    per_rank[r].append(ShardSpec(fqn, dtype, shape, offs, lens, source))
        if kind == "disagree" and ws > 1:
            per_rank[ws - 1].append(ShardSpec(fqn, "int8", shape, (0,) * len(shape), shape))
        for r in range(ws):
            if draw(st.booleans()) and shape and shape[0] > 0 and not odd:  # an empty box of uneven sharding
                per_rank[r].append(ShardSpec(fqn, dtype, shape, (shape[0],) + (0,) * (len(shape) - 1), (0, *shape[1:])))
    plans = []
    for r in range(ws):
        shards = tuple(draw(st.permutations(per_rank[r])))
        blobs = tuple(BlobSpec(f"extra/{r}/{i}", draw(st.integers(0, 300))) for i in range(draw(st.integers(0, 2))))
        plans.append(LocalSavePlan(r, shards, blobs))
    return plans, draw(st.integers(1, 3))


@st.composite
def regular_jobs(draw, partial: bool = False) -> tuple[list[LocalSavePlan], int]:
    """Tensors every rank holds one ``torch.chunk`` of (with empty tails), replicated tensors and
    0-d steps (some with a named replica source), rank-0-only tensors, per-rank blobs and
    per-rank spec orders; ``partial``: tensors split over part of the job too."""
    world = draw(st.integers(2, 9))
    specs: list[list[ShardSpec]] = [[] for _ in range(world)]
    kinds = ["split", "split", "replicated", "step", "rank0"] + (["part-of-job"] if partial else [])
    for t in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(kinds))
        shape = (draw(st.integers(1, 2 * world + 3)), draw(st.integers(1, 3)))
        d = draw(st.integers(0, 1))
        dtype = draw(st.sampled_from(["float32", "bfloat16", "int64"]))
        source = draw(st.sampled_from([None, None, 0, world - 1]))
        fqn = f"model.t{t}"
        for r in range(world):
            if kind in ("split", "part-of-job"):
                parts = world if kind == "split" else max(1, world // 2)
                if kind == "part-of-job" and r >= parts:
                    continue
                lo, n = _chunk(shape[d], parts, r)
                specs[r].append(ShardSpec(fqn, dtype, shape, *_box(shape, d, lo, n)))
            elif kind == "replicated":
                specs[r].append(ShardSpec(fqn, dtype, shape, (0, 0), shape, source))
            elif kind == "step":
                specs[r].append(ShardSpec(fqn, "float32", (), (), (), source))
            else:  # rank 0 holds all of it, the others an empty box
                lens = shape if r == 0 else (0, shape[1])
                specs[r].append(ShardSpec(fqn, dtype, shape, (0, 0), lens))
    plans = []
    shuffle = draw(st.booleans())
    for r in range(world):
        shards = draw(st.permutations(specs[r])) if shuffle else specs[r]
        blobs = tuple(
            BlobSpec(f"loader/{r}/{i}", draw(st.sampled_from([0, 7, 64, 300]))) for i in range(draw(st.integers(0, 2)))
        )
        plans.append(LocalSavePlan(r, tuple(shards), blobs))
    return plans, draw(st.integers(1, 3))


FAMILIES = {
    "mixed": mixed_jobs(),
    "columns": column_jobs(),
    "odd-columns": column_jobs(odd=True),
    "regular": regular_jobs(),
    "regular-over-part-of-the-job": regular_jobs(partial=True),
}


def _past_limits(plans: list[LocalSavePlan]) -> bool:
    """A job the planner documents it refuses: a tensor of more than 2^55 elements, more than
    2^61 bytes of tensors or a blob of more than 2^56 bytes (sizes computed here)."""
    if any(b.nbytes > MAX_BLOB for p in plans for b in p.blobs):
        return True
    if any(math.prod(s.global_shape) > MAX_NUMEL for p in plans for s in p.shards):
        return True
    boxes = {(s.fqn, s.offsets, s.lengths): s for p in plans for s in p.shards}
    return sum(math.prod(s.lengths) * element_size(s.dtype) for s in boxes.values()) > MAX_TOTAL


def _forms(plans: list[LocalSavePlan]) -> dict[str, list]:
    """The job as each caller hands it to ``plan_save``: records, tables, tables decoded from the
    wire bytes, and the coordinator's ``LocalPlans`` (decoded when a table is asked for)."""
    encoded = [encode_local_plan(p) for p in plans]
    return {
        "records": plans,
        "tables": [ShardTable.of(p) for p in plans],
        "decoded tables": [decode_local_table(b) for b in encoded],
        "coordinator": LocalPlans(encoded),
    }


def _outside_layouts(g: GlobalSavePlan, rank: int, item: int, plans: list[LocalSavePlan]) -> bool:
    split = {fqn for _files, entries in g.layouts for fqn, _ in entries}
    return plans[rank].shards[item].fqn not in split


def _lazy_parts_are_the_tuples(got: GlobalSavePlan, want: GlobalSavePlan, plans: list[LocalSavePlan]) -> None:
    """Rank groups' lazy parts give what the oracle's tuple gives: columns, the bytes a rank
    receives, entries outside the layouts, file sizes, the plan under another save id."""
    for r, rp in enumerate(want.rank_plans):
        files_r, rows, blobs = got.rank_rows(r)
        w_files, w_rows, w_blobs = rank_plan_rows(rp)
        assert (files_r, rows.tolist(), blobs) == (w_files, w_rows.tolist(), w_blobs)
        assert decode_rank_plan(encode_rank_rows(r, SAVE_ID, files_r, rows, blobs)) == rp

    def where(x):
        return x[0], x[1].file, x[1].byte_offset

    assert sorted(got.explicit_entries(), key=where) == sorted(
        (
            (rank, e)
            for rank, e in want.explicit_entries()
            if e.blob_key or _outside_layouts(want, rank, e.item_index, plans)
        ),
        key=where,
    )
    assert got.file_ends() == want.file_ends()
    other = got.with_save_id("20250101T000000-feedfacecafe")  # plans name files by (rank, part)
    assert [rp.save_id for rp in other.rank_plans] == ["20250101T000000-feedfacecafe"] * len(plans)
    assert [rp.entries for rp in other.rank_plans] == [rp.entries for rp in want.rank_plans]


@pytest.mark.parametrize("family", list(FAMILIES))
@given(data=st.data())
@settings(max_examples=examples(250), deadline=None)
def test_every_job_is_planned_or_refused_as_by_the_oracle(family, data):
    plans, files = data.draw(FAMILIES[family], label="job")
    forms = _forms(plans)
    got = {form: outcome(plan_save, job, SAVE_ID, files) for form, job in forms.items()}
    if _past_limits(plans):  # refused, where the oracle (Python ints) would plan or refuse
        refusal = got["records"]
        assert isinstance(refusal, tuple) and refusal[0] is PlanningError, refusal
        assert all(g == refusal for g in got.values()), got
        return
    want = outcome(plan_reference, plans, SAVE_ID, files)  # the oracle, once
    if isinstance(want, tuple):  # a refusal: exactly the oracle's error, from every form
        assert all(g == want for g in got.values()), (want, got)
        return
    largest = max([e.byte_length for rp in want.rank_plans for e in rp.entries], default=0)
    for form, plan in got.items():
        assert isinstance(plan, GlobalSavePlan), (form, plan)
        assert isinstance(plan.rank_plans, RegularRankPlans), form  # one driver: rank groups
        assert_same_plan(plan, want)
        assert plan_problems(plans, plan, files) == [], form
        assert max(rank_loads(plan), default=0) <= max(rank_loads(want), default=0) + largest, form
    _lazy_parts_are_the_tuples(got["coordinator"], want, plans)


def test_the_oracle_states_the_invariants():
    """``plan_problems`` finds a box written twice, a misaligned entry, an overlap and a foreign
    file (the oracle's invariants are not vacuous)."""
    plans = [LocalSavePlan(r, (ShardSpec("w", "float32", (4,), (0,), (4,)),), (BlobSpec("b", 3),)) for r in range(2)]
    good = plan_reference(plans, SAVE_ID, 1)
    assert plan_problems(plans, good, 1) == []
    rp0, rp1 = good.rank_plans
    twice = replace(rp1, entries=(*rp1.entries, replace(rp1.entries[0], item_index=0, byte_offset=128, blob_key="")))
    assert any("written 2 times" in p for p in plan_problems(plans, replace(good, rank_plans=(rp0, twice)), 1))
    moved = replace(rp0, entries=tuple(replace(e, byte_offset=e.byte_offset + 8) for e in rp0.entries))
    assert any("aligned" in p for p in plan_problems(plans, replace(good, rank_plans=(moved, rp1)), 1))
    stacked = replace(rp0, entries=tuple(replace(e, byte_offset=0) for e in rp0.entries))
    assert any("overlap" in p for p in plan_problems(plans, replace(good, rank_plans=(stacked, rp1)), 1))
    foreign = replace(rp1, entries=tuple(replace(e, file="r00000-01.bin") for e in rp1.entries))
    assert any("not its own" in p for p in plan_problems(plans, replace(good, rank_plans=(rp0, foreign)), 1))


# ---------------------------------------------------------------- invariants computed here (issue 11)

INVARIANT_SETTINGS = settings(max_examples=examples(150), deadline=None)


@st.composite
def block_jobs(draw, max_ws: int = 6) -> tuple[list[LocalSavePlan], int]:
    """Local plans of a random job: each tensor replicated, or split in blocks along one dim
    (uneven), each block held by one or several ranks (replicas, maybe naming a source rank);
    ranks without a block hold an empty box or nothing; random per-rank blobs."""
    ws = draw(st.integers(1, max_ws))
    per_rank: list[list[ShardSpec]] = [[] for _ in range(ws)]
    for t in range(draw(st.integers(1, 4))):
        fqn = f"model.t{t}"
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=2)))
        dtype = draw(st.sampled_from(DTYPES))
        dim = draw(st.integers(0, len(shape) - 1))
        k = draw(st.integers(1, min(ws, shape[dim])))
        cuts = sorted(draw(st.sets(st.integers(1, shape[dim] - 1), min_size=k - 1, max_size=k - 1))) if k > 1 else []
        bounds = [0, *cuts, shape[dim]]
        holders: dict[int, list[int]] = {b: [b] for b in range(k)}  # block -> ranks
        empty: list[int] = []
        for r in range(k, ws):
            what = draw(st.sampled_from(["replica", "empty", "nothing"]))
            if what == "replica":
                holders[r % k].append(r)
            elif what == "empty":
                empty.append(r)
        for b, ranks in holders.items():
            offs = tuple(bounds[b] if d == dim else 0 for d in range(len(shape)))
            lens = tuple(bounds[b + 1] - bounds[b] if d == dim else shape[d] for d in range(len(shape)))
            source = draw(st.sampled_from(["none", "holder", "any"])) if len(ranks) > 1 else "none"
            named = {"none": None, "holder": draw(st.sampled_from(ranks)), "any": draw(st.integers(0, ws - 1))}
            for r in ranks:
                per_rank[r].append(ShardSpec(fqn, dtype, shape, offs, lens, named[source]))
        for r in empty:
            offs = tuple(shape[d] if d == dim else 0 for d in range(len(shape)))
            lens = tuple(0 if d == dim else shape[d] for d in range(len(shape)))
            per_rank[r].append(ShardSpec(fqn, dtype, shape, offs, lens))
    plans = []
    for r in range(ws):
        shards = draw(st.permutations(per_rank[r]))
        blobs = tuple(BlobSpec(f"extra/{r}/{i}", draw(st.integers(0, 200))) for i in range(draw(st.integers(0, 2))))
        plans.append(LocalSavePlan(r, tuple(shards), blobs))
    return plans, draw(st.integers(1, 3))


def _nbytes(spec: ShardSpec) -> int:
    return numel(spec.lengths) * element_size(spec.dtype)


def _all_writers(plans: list[LocalSavePlan], g: GlobalSavePlan) -> list[tuple]:
    """``g.writers`` (the boxes outside the layouts) and the boxes of the tensors its layouts
    describe: rank r writes ``torch.chunk`` part r (computed here), the spec of its that holds it."""
    out = list(g.writers)
    for _files, entries in g.layouts:
        for fqn, d in entries:
            shape = g.tensors[fqn][1]
            size = -(-shape[d] // len(plans))
            for r, plan in enumerate(plans):
                lo = min(shape[d], r * size)
                n = min(shape[d], lo + size) - lo
                if not n:
                    continue
                offs = tuple(lo if i == d else 0 for i in range(len(shape)))
                lens = tuple(n if i == d else shape[i] for i in range(len(shape)))
                idx = [i for i, s in enumerate(plan.shards) if (s.fqn, s.offsets, s.lengths) == (fqn, offs, lens)]
                assert len(idx) == 1, (fqn, r, idx)
                out.append((fqn, offs, lens, r, idx[0]))
    return out


def _check_plan(plans: list[LocalSavePlan], files_per_rank: int, g: GlobalSavePlan) -> None:
    """Every invariant of a global plan, computed independently of the planner."""
    ws = len(plans)
    writers = _all_writers(plans, g)
    assert not {w[0] for w in g.writers} & {fqn for _f, entries in g.layouts for fqn, _d in entries}
    # tensors: every rank's dtype and shape
    want_tensors = {s.fqn: (s.dtype, s.global_shape) for p in plans for s in p.shards}
    assert g.tensors == want_tensors
    # dedup: the written boxes tile every tensor exactly once; each writer holds its box
    written: dict[str, list] = defaultdict(list)
    for fqn, offs, lens, rank, idx in writers:
        spec = plans[rank].shards[idx]
        assert (spec.fqn, spec.offsets, spec.lengths) == (fqn, offs, lens)
        assert numel(lens) > 0  # empty shards are never written
        written[fqn].append((offs, lens))
    for fqn, (_dtype, shape) in want_tensors.items():
        assert tiles_exactly(shape, written[fqn]), (fqn, shape, written[fqn])
    # replica source: the lowest named source that holds the box writes it
    holders: dict[tuple, list[tuple[int, ShardSpec]]] = defaultdict(list)
    for p in plans:
        for s in p.shards:
            holders[(s.fqn, s.offsets, s.lengths)].append((p.rank, s))
    for fqn, offs, lens, rank, _idx in writers:
        hs = holders[(fqn, offs, lens)]
        ranks = {r for r, _ in hs}
        named = sorted({s.replica_source for _, s in hs if s.replica_source is not None} & ranks)
        if len(hs) > 1 and named:
            assert rank == named[0], (fqn, offs, named, rank)
    # layout: files of each rank, aligned non-overlapping entries, byte sizes from torch
    name = re.compile(r"^r(\d{5})-(\d{2})\.bin$")  # plans name files by (rank, part)
    assert [rp.rank for rp in g.rank_plans] == list(range(ws))
    all_files: list[str] = []
    for rp in g.rank_plans:
        plan = plans[rp.rank]
        assert rp.save_id == g.save_id
        mine = {(idx, s) for s_fqn, offs, lens, r, idx in writers if r == rp.rank for s in [plan.shards[idx]]}
        tensor_entries = [e for e in rp.entries if not e.blob_key]
        blob_entries = [e for e in rp.entries if e.blob_key]
        assert sorted(e.item_index for e in tensor_entries) == sorted(idx for idx, _ in mine)
        for e in tensor_entries:
            assert e.byte_length == _nbytes(plan.shards[e.item_index])
        assert sorted((e.blob_key, e.byte_length) for e in blob_entries) == sorted(
            (b.key, b.nbytes) for b in plan.blobs
        )
        assert all(e.item_index == -1 for e in blob_entries)
        files = list(dict.fromkeys(e.file for e in rp.entries))
        assert len(files) <= files_per_rank
        for f in files:
            m = name.match(f)
            assert m and int(m.group(1)) == rp.rank and int(m.group(2)) < files_per_rank, f
            entries = [e for e in rp.entries if e.file == f]
            ends = 0
            for e in entries:  # in byte order, aligned, not overlapping
                assert e.byte_offset % ALIGN == 0 and e.byte_offset >= ends
                ends = e.byte_offset + e.byte_length
        # entries are grouped by file
        assert [e.file for e in rp.entries] == sorted((e.file for e in rp.entries), key=files.index)
        # list scheduling to the lightest file: file sizes differ by at most the largest item;
        # split tensors laid out alike on every rank (g.layouts) are balanced on chunk 0, the
        # largest: rank 0's files; other ranks' shorter or empty tail chunks follow rank 0's choice
        if len(files) > 1 and (not g.layouts or rp.rank == 0):
            sizes = [sum(e.byte_length for e in rp.entries if e.file == f) for f in files]
            assert max(sizes) - min(sizes) <= max(e.byte_length for e in rp.entries)
        all_files += files
    assert list(g.files) == all_files and len(set(all_files)) == len(all_files)


@given(block_jobs())
@INVARIANT_SETTINGS
def test_issue11_plan_save_invariants_on_random_jobs(job):
    plans, files_per_rank = job
    g = plan_save(plans, "20250101T000000-abc", files_per_rank)
    _check_plan(plans, files_per_rank, g)
    assert plan_save(plans, "20250101T000000-abc", files_per_rank) == g  # deterministic


@given(st.integers(2, 6), st.lists(st.tuples(st.integers(1, 40), st.sampled_from(DTYPES)), min_size=1, max_size=12))
@INVARIANT_SETTINGS
def test_issue11_plan_save_worst_fit_balances_full_replicas(ws, tensors):
    """Pure data parallelism (every rank holds every tensor, no source named): each tensor is
    written once, and the ranks' byte loads differ by at most the largest tensor."""
    plans = [
        LocalSavePlan(r, tuple(ShardSpec(f"model.p{i}", dt, (n,), (0,), (n,)) for i, (n, dt) in enumerate(tensors)))
        for r in range(ws)
    ]
    g = plan_save(plans, "s")
    _check_plan(plans, 1, g)
    load = [0] * ws
    for fqn, _o, lens, rank, _i in g.writers:
        load[rank] += numel(lens) * element_size(g.tensors[fqn][0])
    biggest = max(n * element_size(dt) for n, dt in tensors)
    assert max(load) - min(load) <= biggest, load


# ---------------------------------------------------------------- the metadata: split tensors' layouts


@st.composite
def split_jobs(draw):
    """Tensors every rank holds one chunk of (FSDP ``Shard(0)`` over the job), replicated tensors
    and tensors rank 0 holds alone, with the kind of each (the test's expectation)."""
    world = draw(st.integers(2, 5))
    specs: list[list[ShardSpec]] = [[] for _ in range(world)]
    kinds = {}
    for t in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["split", "split", "replicated", "rows-of-rank0"]))
        shape = (draw(st.integers(1, 12)), draw(st.integers(1, 4)))
        d = draw(st.integers(0, 1)) if kind == "split" else 0
        fqn = f"model.t{t}"
        kinds[fqn] = (kind, d)
        for r in range(world):
            if kind == "split":
                lo, n = _chunk(shape[d], world, r)
                offs = (lo, 0) if d == 0 else (0, lo)
                lens = (n, shape[1]) if d == 0 else (shape[0], n)
            elif kind == "replicated":
                offs, lens = (0, 0), shape
            else:  # rank 0 holds all of it, the others nothing
                offs, lens = (0, 0), (shape if r == 0 else (0, shape[1]))
            specs[r].append(ShardSpec(fqn, "float32", shape, offs, lens))
    files = draw(st.integers(1, 3))
    return [LocalSavePlan(r, tuple(s)) for r, s in enumerate(specs)], files, kinds


def _metadata(gplan, world):
    sums = []
    for rp in gplan.rank_plans:
        ends: dict[str, int] = {}
        for e in rp.entries:
            ends[e.file] = max(ends.get(e.file, 0), e.byte_offset + e.byte_length)
        sums.append((4096, {f: (n, [0] * -(-n // 4096)) for f, n in ends.items()}))
    return build_metadata(gplan, sums, SaveSource("fsdp2", None, ()), world, {})


@given(split_jobs())
@settings(max_examples=examples(60), deadline=None, derandomize=True, database=None)
def test_split_tensors_land_where_their_layout_says(job) -> None:
    """The planned bytes of every split tensor are exactly where the metadata's layout says they
    are, and every other box keeps its row."""
    plans, files, kinds = job
    world = len(plans)
    gplan = plan_save(plans, SAVE_ID, files)
    md = _metadata(gplan, world)
    validate_metadata(md)
    back = decode_metadata(encode_metadata(md))
    planned = {}  # (fqn, rank) -> (file, offset, length), from the rank plans
    for rp in gplan.rank_plans:
        for e in rp.entries:
            fqn = plans[rp.rank].shards[e.item_index].fqn
            planned[(fqn, rp.rank)] = (gplan.files.index(e.file), e.byte_offset, e.byte_length)
    for fqn, (kind, d) in kinds.items():
        rec = back.tensors[fqn]
        shape = rec.shape
        every_chunk = kind == "split" and _chunk(shape[d], world, world - 1)[1] > 0
        laid_out = isinstance(rec.shards, SplitShards)
        if every_chunk:
            assert laid_out, (fqn, kind)
        if kind != "split":
            assert not laid_out, (fqn, kind)
        # split with empty tail chunks: a layout unless a rank would have no file of its part
        if laid_out:
            for r, s in enumerate(rec.shards):  # part r: rank r's chunk, at its planned bytes
                if _chunk(shape[d], world, r)[1]:
                    assert (s.file_index, s.byte_offset, s.byte_length) == planned[(fqn, r)]
                else:
                    assert s.byte_length == 0 and (fqn, r) not in planned
        total = sum(s.byte_length for s in rec.shards)
        assert total == math.prod(shape) * 4


# ---------------------------------------------------------------- the column rules against their plain loops

COLUMN_SETTINGS = settings(max_examples=examples(300), deadline=None)


@given(
    st.lists(st.sampled_from([0, 4, 64, 4800]) | st.integers(0, 5000), max_size=120),
    st.integers(1, 5),
    st.none() | st.lists(st.integers(0, 9000), min_size=5, max_size=5),
)
@COLUMN_SETTINGS
def test_lightest_first_runs_equal_the_heap_loop(sizes, parts, loads):
    """``_lightest_first``'s slots (runs of one size) and its loop give the heap's choices, from
    empty parts or (``loads``) from parts that already hold bytes (a rank's split chunks)."""
    start = [0] * parts if loads is None else loads[:parts]
    ordered = sorted(sizes, reverse=True)
    heap = [(load, p) for p, load in enumerate(start)]
    heapq.heapify(heap)
    want = []
    for size in ordered:
        load, p = heapq.heappop(heap)
        heapq.heappush(heap, (load + size, p))
        want.append(p)
    column = np.array(ordered, dtype=np.int64)
    if loads is None:
        got = _lightest_first(column, parts)
    else:
        got = _lightest_first(column, parts, np.array(start, dtype=np.int64))
    assert got.tolist() == want


@given(st.lists(st.sampled_from([0, 3, 64, 100]) | st.integers(0, 500), max_size=60), st.integers(1, 4))
@COLUMN_SETTINGS
def test_layout_columns_equal_the_record_layout(sizes, parts):
    work = [(n, i, "") for i, n in enumerate(sizes)]
    want = record_layout("s", 3, work, parts)
    order, part, offset = lay_out_rank(np.array(sizes, dtype=np.int64), parts)
    got = [(i, file_name(3, p), off, sizes[i]) for i, p, off in zip(order.tolist(), part.tolist(), offset.tolist())]
    assert got == [(e.item_index, e.file, e.byte_offset, e.byte_length) for e in want]


@given(
    extent=st.integers(0, 40),
    world=st.integers(2, 50),
    other=st.integers(0, 4),
    d=st.integers(0, 1),
)
@COLUMN_SETTINGS
def test_chunk_rule_matches_torch_chunk_parts_only(extent, world, other, d):
    """Row r is ruled along d exactly when its box is torch.chunk part r (torch's sizes, computed
    here), the other dimension whole and part 0 not the whole extent."""
    shape = (extent, other) if d == 0 else (other, extent)
    pieces = torch.chunk(torch.arange(extent), world) if extent else ()
    for r in range(world):
        lo = sum(len(p) for p in pieces[:r]) if r < len(pieces) else extent
        n = len(pieces[r]) if r < len(pieces) else 0
        offs = tuple(lo if i == d else 0 for i in range(2))
        lens = tuple(n if i == d else shape[i] for i in range(2))
        full = (tuple(0 for _ in shape), shape)
        table = ShardTable.of(
            LocalSavePlan(r, (ShardSpec("t", "float32", shape, offs, lens), ShardSpec("u", "float32", shape, *full)))
        )
        rule = chunk_rule(table, world).tolist()
        part0_whole = not pieces or len(pieces[0]) == extent
        assert rule == [-1 if part0_whole else d, -1], (shape, r, offs, lens)


@given(
    st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40), st.integers(0, 2)), max_size=8),
    st.integers(1, 12),
)
@settings(max_examples=examples(200), deadline=None)
def test_chunk_sums_equal_the_per_rank_loop(tensors, world):
    """Each rank's chunk bytes per part, aligned bytes and whether it holds any, summed over the
    ranks' ``torch.chunk`` rows (computed here per rank), without a (ranks, tensors) array."""
    parts = 3
    loads = [[0] * parts for _ in range(world)]
    ends = [[0] * parts for _ in range(world)]
    uses = [[False] * parts for _ in range(world)]
    for extent, row_bytes, part in tensors:
        for r in range(world):
            _, n = _chunk(extent, world, r)
            loads[r][part] += n * row_bytes
            ends[r][part] += -(-n * row_bytes // 64) * 64
            uses[r][part] |= n > 0
    extent, row_bytes, part = (np.array([t[k] for t in tensors], dtype=np.int64) for k in range(3))
    got = _chunk_sums(extent, -(-extent // world), row_bytes, part, parts, world) if tensors else None
    if got is not None:
        assert (got[0].tolist(), got[1].tolist(), got[2].tolist()) == (loads, ends, uses)
