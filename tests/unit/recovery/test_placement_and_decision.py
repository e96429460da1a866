"""The pure parts of fast recovery (issue 40): the ring placement and the one recovery decision."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unickpt.errors import ConfigurationError
from unickpt.recovery.decide import choose
from unickpt.recovery.placement import ring_placement, transfer_pairs

HOSTS = st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=9)


@given(HOSTS, st.integers(0, 8), st.data())
def test_issue40_item1_placement_puts_each_hosts_chunks_on_replicas_distinct_other_hosts(hosts, replicas, data):
    ring = sorted(set(hosts))
    domains = {h: data.draw(st.sampled_from("xyz")) for h in ring} if data.draw(st.booleans()) else None
    if replicas >= len(ring) and replicas > 0:
        with pytest.raises(ConfigurationError, match=f"replicas={replicas} needs at least"):
            ring_placement(hosts, replicas, domains)
        return
    got = ring_placement(hosts, replicas, domains)
    assert set(got) == set(ring)
    for host, targets in got.items():
        assert len(targets) == len(set(targets)) == replicas and host not in targets
        if domains is not None:  # other failure domains first
            others = sum(domains[h] != domains[host] for h in ring)
            assert [domains[t] != domains[host] for t in targets] == [True] * min(replicas, others) + [False] * max(
                0, replicas - others
            )
    assert len(transfer_pairs(got)) == replicas * len(ring)


def test_issue40_item1_placement_without_domains_is_the_next_hosts_of_the_sorted_ring():
    assert ring_placement(["c", "a", "b", "a"], 1) == {"a": ("b",), "b": ("c",), "c": ("a",)}
    assert ring_placement(["a", "b", "c", "d"], 2, {"a": "r1", "b": "r1", "c": "r2", "d": "r2"})["a"] == ("c", "d")


def _rec(step, sid, files, required):
    entries = [{"name": n, "origin": o, "where": w, "size": 4, "crcs": [c]} for n, o, w, c in files]
    return {"step": step, "save_id": sid, "chunk": 4, "required": required, "files": entries}


def test_issue40_item3_the_decision_takes_the_newest_step_with_a_copy_of_every_file():
    inv = {
        "a": {"step_2": _rec(2, "s2", [("f", "a", "primary", 1)], ["f", "g"]),
              "step_1": _rec(1, "s1", [("f", "a", "primary", 1)], ["f"])},
        "b": {"step_2": _rec(2, "s2", [("g", "b", "primary", 7), ("f", "a", "replica", 9)], ["f", "g"])},
    }  # fmt: skip
    d = choose(inv, durable_step=None)
    assert (d["source"], d["step"]) == ("ram", 2)
    assert d["holders"] == {"f": [["a", "primary", "a"]], "g": [["b", "primary", "b"]]}  # b's f: other CRC
    assert choose(inv, None, excluded=[["step_2", "s2"]])["step"] == 1
    assert choose(inv, durable_step=3)["source"] == "durable"
    assert choose(inv, durable_step=2)["source"] == "ram"  # a tie goes to RAM
    del inv["b"]
    d = choose(inv, durable_step=None)
    assert d["step"] == 1 and d["incomplete"] == [[2, "s2", "g"]]
    assert choose({}, None)["source"] == "none"
