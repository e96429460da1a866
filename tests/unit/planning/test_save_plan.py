"""Replica choice in the save planner (planning.save): pure, no processes."""

from __future__ import annotations

from unickpt.planning.save import LocalSavePlan, plan_save
from unickpt.planning.specs import ShardSpec


def _writer(plan, fqn: str) -> int:
    return next(rank for f, _o, _l, rank, _i in plan.writers if f == fqn)


def test_replica_source_honoured_and_others_balanced() -> None:
    """A buffer replicated on 4 ranks whose spec names rank 0 as its source is written by rank 0
    even when worst-fit would pick another; parameters without a source are balanced."""
    plans = []
    for r in range(4):
        shards = (
            ShardSpec("model.w", "float32", (64,), (0,), (64,)),  # replicated parameter
            ShardSpec("model.bn.running_mean", "float32", (8,), (0,), (8,), replica_source=0),
            ShardSpec("model.bn.running_var", "float32", (8,), (0,), (8,), replica_source=0),
        )
        plans.append(LocalSavePlan(r, shards))
    plan = plan_save(plans, "s")
    assert _writer(plan, "model.bn.running_mean") == 0 and _writer(plan, "model.bn.running_var") == 0
    assert _writer(plan, "model.w") != 0  # rank 0 already holds the buffers: the big one goes elsewhere


def test_replica_source_not_a_holder_falls_back_to_balancing() -> None:
    plans = [LocalSavePlan(r, (ShardSpec("model.b", "float32", (4,), (0,), (4,), replica_source=3),)) for r in range(2)]
    assert _writer(plan_save(plans, "s"), "model.b") in (0, 1)


def test_replica_groups_naming_different_sources_take_the_lowest() -> None:
    plans = [
        LocalSavePlan(r, (ShardSpec("model.b", "float32", (4,), (0,), (4,), replica_source=2 * (r // 2)),))
        for r in range(4)
    ]
    assert _writer(plan_save(plans, "s"), "model.b") == 0
