"""Plan reuse across N ranks in one process (``unickpt.testing.threads``):
``engine.plan_cache.plan_stage`` with each rank's ``PlanCache``, keyed by ``PlanKey`` as the save
pipeline does. Unchanged local plans reuse the global plan in one tiny all_gather that carries
rank 0's fresh save id; one rank's change (or a rank without a cached plan) replans on every
rank; a changed ``files_per_rank`` is another key. Issue 11: "tests of plan reuse ... that do not exist today"."""

from __future__ import annotations

import dataclasses
import itertools
import threading

import pytest

from unickpt.engine import plan_cache as engine_plan_cache
from unickpt.engine.plan_cache import CachedPlan, PlanCache, PlanKey, plan_stage
from unickpt.errors import PlanningError
from unickpt.planning.save import GlobalSavePlan, LocalSavePlan, RankSavePlan
from unickpt.planning.save.model import data_path
from unickpt.planning.specs import BlobSpec, ShardSpec
from unickpt.testing.threads import ThreadCoordinator, run_threads

WORLD_SIZES = [1, 2, 3, 5]
PLAN = ["all_gather_object", "gather_object", "scatter_object"]  # a replan at ws > 1
REUSE = ["all_gather_object"]


@pytest.fixture(autouse=True)
def traceable_save_ids(monkeypatch):
    """Save ids that name the rank (thread) that drew them: ``<stamp>-r<rank>n<k>``."""
    counters: dict[str, itertools.count] = {}
    lock = threading.Lock()

    def new_save_id() -> str:
        name = threading.current_thread().name  # "threads-rank<r>"
        with lock:
            k = next(counters.setdefault(name, itertools.count()))
        return f"20250101T000000-r{name.rsplit('rank', 1)[-1]}n{k}"

    monkeypatch.setattr(engine_plan_cache, "new_save_id", new_save_id)


def local_plan(rank: int, ws: int, rows: int = 11, blob: int = 10) -> LocalSavePlan:
    """An FSDP-like row-sharded weight (uneven), a replicated bias and one blob per rank."""
    lo, hi = rank * rows // ws, (rank + 1) * rows // ws
    shards = (
        ShardSpec("model.w", "float32", (rows, 3), (lo, 0), (hi - lo, 3)),
        ShardSpec("model.b", "float32", (3,), (0,), (3,)),
    )
    return LocalSavePlan(rank, shards, (BlobSpec(f"extra_state/{rank}", blob),))


def save(c: ThreadCoordinator, cache: PlanCache, local: LocalSavePlan, files_per_rank: int = 1) -> dict:
    """One save's planning, as the save pipeline does it; what it cost and gave."""
    key = PlanKey(None, "fsdp2", files_per_rank)
    before = len(c.calls)
    cached = plan_stage(c, local, files_per_rank, cache.get(key))
    cache.put(key, cached)
    if c.rank > 0:
        assert cached.coordinator is None  # only the coordinator holds the global plan
    return {
        "plan": cached.mine,  # this rank's own part: all it received and renames on reuse
        "global": cached.global_plan() if c.rank == 0 else None,
        "calls": c.calls[before:],
        "seq": cached.seq,
        "base": cached.base,
    }


def _renamed_part(rp: RankSavePlan, old: str, new: str) -> RankSavePlan:
    """``rp`` for save ``new`` (files are named by rank and part: the entries stay)."""
    assert rp.save_id == old
    return dataclasses.replace(rp, save_id=new)


def _renamed(plan: GlobalSavePlan, old: str, new: str) -> GlobalSavePlan:
    """``plan`` for save ``new`` (computed here)."""
    rank_plans = tuple(_renamed_part(rp, old, new) for rp in plan.rank_plans)
    return dataclasses.replace(plan, save_id=new, rank_plans=rank_plans)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_issue11_plan_reuse_unchanged_plans_reuse_with_a_fresh_id_from_rank_0(ws):
    def body(c: ThreadCoordinator) -> list[dict]:
        cache = PlanCache()
        return [save(c, cache, local_plan(c.rank, ws)) for _ in range(3)]

    res = run_threads(body, ws)
    first, second, third = ([r[i] for r in res] for i in range(3))
    base = "20250101T000000-r0n0"  # rank 0's id of the first save
    whole = first[0]["global"]
    for rank, out in enumerate(first):
        assert out["calls"] == (PLAN if ws > 1 else [])
        assert out["plan"] == whole.rank_plans[rank] and out["plan"].save_id == base
    for k, saves in ((1, second), (2, third)):
        want = f"{base}-{k:06d}-r0n{k}"  # rank 0's k-th fresh id gives the token
        assert saves[0]["global"] == _renamed(whole, base, want)
        for rank, out in enumerate(saves):
            assert out["calls"] == (REUSE if ws > 1 else [])  # no gather, no scatter
            assert out["seq"] == k and out["base"] == base
            assert out["plan"] == _renamed_part(whole.rank_plans[rank], base, want)
    assert {data_path(third[0]["global"].save_id, f).split("/")[1] for f in third[0]["global"].files} == {
        third[0]["plan"].save_id
    }
    assert not any(first[0]["plan"].save_id in f for f in third[0]["global"].files)  # no save id in a plan


@pytest.mark.parametrize("ws", [2, 3, 5])
def test_issue11_plan_reuse_one_ranks_change_replans_on_every_rank(ws):
    changer = ws - 1

    def body(c: ThreadCoordinator) -> list[dict]:
        cache = PlanCache()
        out = [save(c, cache, local_plan(c.rank, ws))]
        blob = 50 if c.rank == changer else 10  # only one rank's local plan changes
        out.append(save(c, cache, local_plan(c.rank, ws, blob=blob)))
        out.append(save(c, cache, local_plan(c.rank, ws, blob=blob)))  # unchanged again: reuse
        return out

    res = run_threads(body, ws)
    for rank, (first, changed, again) in enumerate(res):
        assert changed["calls"] == PLAN, rank  # every rank replans, not only the changer
        assert changed["plan"].save_id == "20250101T000000-r0n1" and changed["seq"] == 0
        blobs = [e for e in res[0][1]["global"].rank_plans[changer].entries if e.blob_key]
        assert [(e.blob_key, e.byte_length) for e in blobs] == [(f"extra_state/{changer}", 50)]
        assert changed["plan"] == res[0][1]["global"].rank_plans[rank]
        assert again["calls"] == REUSE and again["base"] == "20250101T000000-r0n1" and again["seq"] == 1
        assert first["plan"].save_id != changed["plan"].save_id


@pytest.mark.parametrize("ws", [2, 3])
def test_issue11_plan_reuse_a_rank_without_a_cached_plan_replans_on_every_rank(ws):
    """A rank whose cache lost the plan (a restarted process, a new Checkpointer) votes
    "changed": the others must not reuse a plan that rank does not hold."""

    def body(c: ThreadCoordinator) -> list[dict]:
        cache = PlanCache()
        out = [save(c, cache, local_plan(c.rank, ws))]
        if c.rank == 1:
            cache.clear()
        out.append(save(c, cache, local_plan(c.rank, ws)))
        return out

    for first, second in run_threads(body, ws):
        assert second["calls"] == PLAN and second["seq"] == 0
        assert second["plan"] == _renamed_part(first["plan"], first["plan"].save_id, "20250101T000000-r0n1")


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_issue11_plan_reuse_a_changed_files_per_rank_key_replans(ws):
    def body(c: ThreadCoordinator) -> list[dict]:
        cache = PlanCache()
        local = local_plan(c.rank, ws)
        return [save(c, cache, local, 1), save(c, cache, local, 2), save(c, cache, local, 1), save(c, cache, local, 2)]

    res = run_threads(body, ws)
    for one, two, one_again, two_again in res:
        assert two["calls"] == (PLAN if ws > 1 else [])  # another key: a new plan
        assert len(one["plan"].files) == 1
        assert len(two["plan"].files) == 2  # each rank has 2 or 3 items
        assert one_again["calls"] == (REUSE if ws > 1 else []) and one_again["base"] == one["plan"].save_id
        assert two_again["calls"] == (REUSE if ws > 1 else []) and two_again["base"] == two["plan"].save_id
        assert len(one_again["plan"].files) == 1
    assert PlanKey(None, "fsdp2", 1) != PlanKey(None, "fsdp2", 2) != PlanKey("critic", "fsdp2", 2)


@pytest.mark.parametrize("ws", [2, 3])
def test_issue11_plan_reuse_a_refused_plan_fails_every_rank_and_caches_nothing(ws):
    """Rank 0's planner refuses (ranks disagree on a shape): every rank raises the same
    PlanningError; nothing is cached, and the next valid save plans afresh."""

    def body(c: ThreadCoordinator) -> dict:
        cache = PlanCache()
        bad = local_plan(c.rank, ws, rows=12 if c.rank == ws - 1 else 11)
        try:
            save(c, cache, bad)
            refused = ""
        except PlanningError as e:
            refused = str(e)
        assert cache.get(PlanKey(None, "fsdp2", 1)) is None
        ok = save(c, cache, local_plan(c.rank, ws))
        return {
            "refused": refused,
            "calls": ok["calls"],
            "cached": isinstance(cache.get(PlanKey(None, "fsdp2", 1)), CachedPlan),
        }

    res = run_threads(body, ws)
    for r in res:
        assert f"model.w: rank {ws - 1} has dtype float32 shape (12, 3)" in r["refused"], r["refused"]
        assert r["refused"] == res[0]["refused"]
        assert r["calls"] == PLAN and r["cached"]
