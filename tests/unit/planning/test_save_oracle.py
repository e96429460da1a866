"""``plan_save`` against the reference oracle (``tests.support.save_oracle``), on random jobs
mixing every case the planner once left to a separate record planner (hypothesis): regular
tensors (every rank one ``torch.chunk`` part), irregular blocks with replicas and named sources,
replicated tensors and 0-d steps, a rank holding one box twice, ranks holding nothing, jobs of
blobs only, large sizes (far inside int64: planned; past the documented limits: refused), and
refusals (a block nobody holds, ranks disagreeing on a dtype).
For every job the plan (or the refusal) equals the oracle's, and the plan satisfies the
invariants the oracle states from the entries alone (``plan_problems``: every byte of every
record written exactly once, 64-byte alignment, at most ``files_per_rank`` files per rank), with
the ranks' byte loads no worse than the oracle's by more than one record."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.boxes import element_size
from tests.support.hypothesis_profiles import examples
from tests.support.save_oracle import outcome as _outcome
from tests.support.save_oracle import plan_problems, plan_reference, rank_loads
from unickpt.errors import PlanningError
from unickpt.planning.save import GlobalSavePlan, LocalSavePlan, plan_save
from unickpt.planning.save.wire import LocalPlans, encode_local_plan
from unickpt.planning.specs import BlobSpec, ShardSpec

SETTINGS = settings(max_examples=examples(250), deadline=None)
SAVE_ID = "20250101T000000-0123456789ab"
# the planner's documented limits (planning/save/columns.py): no machine holds more
MAX_NUMEL, MAX_TOTAL, MAX_BLOB = 1 << 55, 1 << 61, 1 << 56


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    c = -(-n // parts)
    lo = min(n, i * c)
    return lo, min(n, lo + c) - lo


def _box(shape: tuple[int, ...], d: int, lo: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(lo if i == d else 0 for i in range(len(shape))), tuple(n if i == d else s for i, s in enumerate(shape))


@st.composite
def jobs(draw) -> tuple[list[LocalSavePlan], int]:
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


def _past_limits(plans: list[LocalSavePlan]) -> bool:
    """A job the planner documents it refuses: a tensor of more than 2^55 elements, more than
    2^61 bytes of tensors or a blob of more than 2^56 bytes (sizes computed here)."""
    if any(b.nbytes > MAX_BLOB for p in plans for b in p.blobs):
        return True
    if any(math.prod(s.global_shape) > MAX_NUMEL for p in plans for s in p.shards):
        return True
    boxes = {(s.fqn, s.offsets, s.lengths): s for p in plans for s in p.shards}
    return sum(math.prod(s.lengths) * element_size(s.dtype) for s in boxes.values()) > MAX_TOTAL


def _same(a: GlobalSavePlan, b: GlobalSavePlan) -> None:
    assert (a.save_id, a.files, a.layouts, a.writers) == (b.save_id, b.files, b.layouts, b.writers)
    assert list(a.tensors.items()) == list(b.tensors.items())
    assert list(a.rank_plans) == list(b.rank_plans)


@given(jobs())
@SETTINGS
def test_every_job_is_planned_or_refused_as_by_the_oracle(job):
    plans, files = job
    got = _outcome(plan_save, plans, SAVE_ID, files)
    coordinator = _outcome(plan_save, LocalPlans([encode_local_plan(p) for p in plans]), SAVE_ID, files)
    if _past_limits(plans):  # refused, where the oracle (Python ints) would plan or refuse
        assert isinstance(got, tuple) and got[0] is PlanningError, got
        assert coordinator == got
        return
    want = _outcome(plan_reference, plans, SAVE_ID, files)
    if isinstance(want, tuple):  # a refusal: exactly the oracle's error
        assert got == want and coordinator == want
        return
    for plan in (got, coordinator):
        assert isinstance(plan, GlobalSavePlan), plan
        _same(plan, want)
        assert plan_problems(plans, plan, files) == []
        largest = max([e.byte_length for rp in want.rank_plans for e in rp.entries], default=0)
        assert max(rank_loads(plan), default=0) <= max(rank_loads(want), default=0) + largest


def test_the_oracle_states_the_invariants():
    """``plan_problems`` finds a box written twice, a misaligned entry, an overlap and a foreign
    file (the oracle's invariants are not vacuous)."""
    from dataclasses import replace

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
