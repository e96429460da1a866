"""The tests that start processes of the subject of ``tests/unit/coordination/test_coordination_objects.py``:
unickpt's object collectives on real gloo ranks, each object checked against what its rank
built, and the transfers counted (one collective for small objects; one more transfer, of the
kind the module docstring names, only where an object did not fit its slot)."""

from __future__ import annotations

import pytest

from tests.workers.harness import run_ranks
from tests.workers.object_workers import BIG, codecs, collectives, obj_of, subgroup


@pytest.mark.parametrize("big_ranks", [[], [2], [0, 1, 2]], ids=["small", "one-big", "all-big"])
def test_object_collectives_deliver_every_object_in_one_round_when_small(big_ranks):
    ws = 3
    res = run_ranks(collectives, ws, big_ranks, timeout=120)
    everyone = [obj_of(r, r in big_ranks) for r in range(ws)]
    big = bool(big_ranks)
    for rank, got in enumerate(res):
        assert got["all_gather"]["got"] == everyone
        assert got["all_gather"]["calls"] == {"all_gather": 2 if big else 1}
        assert got["broadcast"]["got"] == obj_of(1, 1 in big_ranks)
        assert got["broadcast"]["calls"] == {"broadcast": 2 if 1 in big_ranks else 1}
        assert got["gather"]["got"] == (everyone if rank == 2 else None)
        sent_to_gather = [r for r in big_ranks if r != 2]
        want = {"gather": 1}
        if rank == 2 and sent_to_gather:
            want["recv"] = len(sent_to_gather)
        if rank != 2 and rank in big_ranks:
            want["send"] = 1
        assert got["gather"]["calls"] == want, rank
        assert got["scatter"]["got"] == obj_of(10 + rank, rank in big_ranks)
        want = {"scatter": 1}
        if rank == 1 and [r for r in big_ranks if r != 1]:
            want["isend"] = len([r for r in big_ranks if r != 1])
        if rank != 1 and rank in big_ranks:
            want["recv"] = 1
        assert got["scatter"]["calls"] == want, rank
    assert len(obj_of(0, True)["blob"]) == BIG


def test_object_collectives_on_a_subgroup_map_group_ranks_to_global_ones():
    res = run_ranks(subgroup, 3, timeout=120)
    assert res[0] == {}
    for rank in (1, 2):
        got = res[rank]
        assert got["all_gather"] == [obj_of(1, True), obj_of(2, True)]
        assert got["broadcast"] == obj_of(2, True)
        assert got["gather"] == ([obj_of(1, True), obj_of(2, True)] if rank == 1 else None)
        assert got["scatter"] == obj_of(7 if rank == 1 else 8, True)


def test_the_ram_tiers_codecs_carry_json_values_and_raw_bytes():
    res = run_ranks(codecs, 3, timeout=120)
    everyone = [{"rank": r, "steps": list(range(r * 3000))} for r in range(3)]
    for got in res:
        assert got["json"] == everyone
        assert got["raw_small"] == bytes([0]) * 10
        assert got["raw_large"] == bytes([9]) * BIG
