"""Merging the ranks' JSON objects at commit (planning.objects): pure, no processes."""

from __future__ import annotations

import pytest

from unickpt.errors import PlanningError
from unickpt.format.values import decode_value, encode_value
from unickpt.planning.objects import merge_rank_objects


def opt(groups: list[tuple[dict, list[str]]], values: dict | None = None) -> dict:
    obj = {"param_groups": [{**h, "params": p} for h, p in groups], "state_values": values or {}}
    return {"optimizer": encode_value(obj, "optimizer")}


A = {"lr": 0.1, "betas": (0.9, 0.99)}
B = {"lr": 0.2, "betas": (0.8, 0.9)}


def test_replicas_merge_into_one_copy() -> None:
    per_rank = [opt([(A, ["w", "b"])]) for _ in range(64)]
    merged = decode_value(merge_rank_objects(per_rank)["optimizer"])
    assert merged["param_groups"] == [{**A, "params": ["w", "b"]}]


def test_stages_keep_their_own_groups() -> None:
    merged = decode_value(
        merge_rank_objects([opt([(A, ["l0.w"]), (B, ["l1.w"])]), opt([(B, ["l2.w"]), (A, ["l3.w"])])])["optimizer"]
    )
    assert merged["param_groups"] == [{**A, "params": ["l0.w", "l3.w"]}, {**B, "params": ["l1.w", "l2.w"]}]


def test_same_parameter_different_hyperparameters_names_both_ranks() -> None:
    with pytest.raises(PlanningError) as info:
        merge_rank_objects([opt([(A, ["w"])]), opt([(A, ["v"])]), opt([(B, ["w"])])])
    msg = str(info.value)
    assert "'w'" in msg and "rank 0" in msg and "rank 2" in msg and "0.2" in msg


def test_state_values_must_agree() -> None:
    merge_rank_objects([opt([(A, ["w"])], {"w": {"n": 1}}), opt([(A, ["w"])], {"w": {"n": 1}})])
    with pytest.raises(PlanningError, match="rank 0 and rank 1"):
        merge_rank_objects([opt([(A, ["w"])], {"w": {"n": 1}}), opt([(A, ["w"])], {"w": {"n": 2}})])


def test_other_objects_identical_or_refused() -> None:
    assert merge_rank_objects([{"x": 1}, {"x": 1}, {}]) == {"x": 1}
    with pytest.raises(PlanningError, match="'x'"):
        merge_rank_objects([{"x": 1}, {"x": 2}])
