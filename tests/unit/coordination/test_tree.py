"""Tree coordination (``coordination.tree``) on thread-ranks: every collective gives what the flat
one gives (rank order included), at many shapes; save planning and ``run_stage`` over the tree
equal their flat results; a failing rank makes the others raise a ``CollectiveError`` that travels
the tree (up to rank 0, then down), so ranks of other hosts raise the same error."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from unickpt.coordination.base import run_stage
from unickpt.coordination.topology import TreeLayout, host_sizes
from unickpt.coordination.tree import TreeCoordinator
from unickpt.engine import plan_cache as engine_plan_cache
from unickpt.engine.plan_cache import plan_stage
from unickpt.errors import CollectiveError, RankFailures, StorageError
from unickpt.planning.save import LocalSavePlan
from unickpt.planning.specs import BlobSpec, ShardSpec
from unickpt.testing.threads import run_threads

SHAPES = [  # (host sizes, fan-out)
    ([4, 4], 2),
    ([1, 1, 1, 1, 1], 2),
    ([3, 1, 2], 2),
    ([2, 2, 2, 2, 2, 2, 1], 3),
    ([5], 4),
    ([2, 3, 1, 4, 2, 2, 1, 1, 3], 2),
]


def _value(rank: int) -> dict[str, Any]:
    return {"rank": rank, "tag": "x" * (rank % 3), "nested": [rank, (rank, str(rank))]}


def _collectives(c: Any) -> dict[str, Any]:
    ws = c.world_size
    out: dict[str, Any] = {}
    out["all_gather"] = c.all_gather_object(_value(c.rank))
    out["gather"] = c.gather_object(_value(c.rank))
    out["gather_dst1"] = c.gather_object(c.rank * 10, dst=min(1, ws - 1))
    out["broadcast"] = c.broadcast_object({"from": c.rank} if c.rank == 0 else None)
    out["broadcast_src_last"] = c.broadcast_object(c.rank if c.rank == ws - 1 else None, src=ws - 1)
    out["scatter"] = c.scatter_object([_value(r) for r in range(ws)] if c.rank == 0 else None)
    out["scatter_src_last"] = c.scatter_object(list(range(100, 100 + ws)) if c.rank == ws - 1 else None, src=ws - 1)
    c.barrier()
    out["after_barrier"] = c.all_gather_object(c.rank)
    return out


@pytest.mark.parametrize(("sizes", "fan_out"), SHAPES, ids=[f"{s}-f{f}" for s, f in SHAPES])
def test_tree_collectives_equal_flat_ones(sizes, fan_out):
    layout = TreeLayout.build(sizes, fan_out)
    ws = layout.world_size
    flat = run_threads(_collectives, ws, timeout=20)
    tree = run_threads(lambda c: (isinstance(c, TreeCoordinator), _collectives(c)), ws, timeout=20, tree=layout)
    assert all(is_tree for is_tree, _ in tree)
    assert [r for _, r in tree] == flat
    assert flat[0]["all_gather"] == [_value(r) for r in range(ws)]  # rank order
    assert flat[0]["gather"] == [_value(r) for r in range(ws)] and all(r["gather"] is None for r in flat[1:])
    assert [r["scatter"] for r in flat] == [_value(r) for r in range(ws)]


def _local_plan(rank: int, ws: int) -> LocalSavePlan:
    rows = 4 * ws + 3
    lo, hi = rank * rows // ws, (rank + 1) * rows // ws
    shards = (
        ShardSpec("model.w", "float32", (rows, 5), (lo, 0), (hi - lo, 5)),
        ShardSpec("model.b", "float32", (7,), (0,), (7,)),  # replicated: dedup + balancing
        ShardSpec(f"model.own{rank % 3}", "float16", (3, 3), (0, 0), (3, 3)),
    )
    return LocalSavePlan(rank, shards, (BlobSpec(f"extra_state/{rank}", 10 + rank),))


def test_save_plans_over_the_tree_equal_flat_ones(monkeypatch):
    monkeypatch.setattr(engine_plan_cache, "new_save_id", lambda: "20250101T000000-fixed")
    layout = TreeLayout.build(host_sizes(10, ranks_per_host=3), 2)

    def plan(c: Any) -> tuple[Any, Any]:
        cached = plan_stage(c, _local_plan(c.rank, c.world_size), 2)
        return cached.mine, cached.coordinator

    flat = run_threads(plan, 10, timeout=20)
    tree = run_threads(plan, 10, timeout=20, tree=layout)
    assert tree == flat
    assert flat[0][1] is not None and all(g is None for _, g in flat[1:])
    assert [mine.rank for mine, _ in tree] == list(range(10))


def test_run_stage_over_the_tree_keeps_its_contract():
    layout = TreeLayout.build([2, 2, 1], 2)

    def stage(c: Any) -> dict[str, Any]:
        ok = run_stage(c, "save (describe)", lambda: c.rank * 2)

        def fail() -> None:
            if c.rank in (1, 4):
                raise StorageError(f"rank {c.rank}: disk full")

        def mixed() -> None:
            if c.rank == 3:
                raise KeyError("odd")
            if c.rank == 0:
                raise StorageError("rank 0: broken")

        out: dict[str, Any] = {"ok": ok}
        for name, fn in (("same", fail), ("mixed", mixed)):
            try:
                run_stage(c, "save (write)", fn)
            except Exception as e:
                out[name] = (type(e).__name__, str(e), sorted(getattr(e, "failures", {})))
        return out

    res = run_threads(stage, 5, timeout=20, tree=layout)
    assert [r["ok"] for r in res] == [0, 2, 4, 6, 8]
    assert {r["same"][0] for r in res} == {"StorageError"}
    assert all("rank 1, save (write): disk full" in r["same"][1] and "rank 4" in r["same"][1] for r in res)
    assert {r["mixed"][0] for r in res} == {RankFailures.__name__} and all(r["mixed"][2] == [0, 3] for r in res)


def test_a_rank_that_leaves_fails_every_other_rank_through_the_tree():
    """Rank 5 (not a leader) leaves instead of joining an all_gather: its host's leader (4) fails
    at once, hands the failure up to rank 0, which sends it down to every rank of host 0."""
    layout = TreeLayout.build([4, 4], 2)
    errors: dict[int, BaseException] = {}

    def body(c: Any) -> str:
        c.barrier()
        if c.rank == 5:
            return "left"
        try:
            c.all_gather_object(c.rank)
        except CollectiveError as e:
            errors[c.rank] = e
            return "raised"
        return "returned"

    res = run_threads(body, 8, timeout=60, tree=layout)
    assert res == ["raised"] * 5 + ["left", "raised", "raised"]
    assert all(isinstance(e, CollectiveError) for e in errors.values())
    # ranks 0-4 raise the one record that reached rank 0 (rank 4's), with the same message
    assert len({str(errors[r]) for r in range(5)}) == 1, {r: str(errors[r]) for r in range(5)}
    assert "left" in str(errors[0]) or "returned" in str(errors[0]), str(errors[0])


def test_a_rank_that_never_arrives_makes_the_others_time_out_with_one_error():
    layout = TreeLayout.build([2, 2, 2], 2)
    released = threading.Event()
    errors: dict[int, BaseException] = {}

    def body(c: Any) -> None:
        c.barrier()
        if c.rank == 3:
            released.wait(120)  # joins nothing until the others have failed
            return
        try:
            c.all_gather_object(c.rank)
        except CollectiveError as e:
            errors[c.rank] = e
        finally:
            if len(errors) == 5:
                released.set()

    run_threads(body, 6, timeout=2, tree=layout)
    assert sorted(errors) == [0, 1, 2, 4, 5]
    assert all(isinstance(e, TimeoutError) for e in errors.values()), errors
    # rank 2 (rank 3's leader) timed out and handed that up (or rank 0 timed out waiting for it):
    # every rank outside host 1 raises what rank 0 sent down
    assert len({str(errors[r]) for r in (0, 1, 4, 5)}) == 1, {r: str(e) for r, e in errors.items()}


def test_a_dead_peer_names_only_absent_members_of_the_group_that_saw_it(tmp_path):
    """CI once saw 'rank(s) [0, 3] had not arrived' when rank 3 died: its host leader (rank 2)
    read the arrivals while rank 0 was merely not there yet. A peer's death (not a timeout) is
    reported with the absent ranks of the failing group only; a timeout still names every rank
    that did not arrive."""
    from datetime import timedelta

    import torch.distributed as dist

    from unickpt.coordination.torch_dist import _failure
    from unickpt.errors import CollectiveTimeoutError

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        died = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        err = _failure("save", "gather", died, 0.02, timedelta(seconds=10), [0, 3], among=(2, 3))
        assert type(err) is CollectiveError and err.missing_ranks == (3,), err
        assert "rank(s) [3] had not arrived" in str(err)
        late = RuntimeError("Timed out waiting 10000ms")
        err = _failure("save", "gather", late, 10.0, timedelta(seconds=10), [0, 3], among=(2, 3))
        assert type(err) is CollectiveTimeoutError and err.missing_ranks == (0, 3), err
    finally:
        dist.destroy_process_group()
