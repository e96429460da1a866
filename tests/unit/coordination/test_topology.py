"""The tree's shape (``coordination.topology``): hosts from a block size or from host names,
levels of ``fan_out`` leaders, each rank's path, contiguous spans; the options and their
environment defaults. Pure functions, no processes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.coordination.topology import (
    RANKS_PER_HOST_ENV,
    TREE_FAN_OUT_ENV,
    TREE_MIN_WORLD_SIZE_ENV,
    CoordinationOptions,
    TreeLayout,
    host_sizes,
)


def test_two_hosts_of_four_fan_out_two():
    layout = TreeLayout.build(host_sizes(8, 4), 2)
    assert [[g.members for g in lv] for lv in layout.levels] == [[(0, 1, 2, 3), (4, 5, 6, 7)], [(0, 4)]]
    assert [(lv, g.members) for lv, g in layout.path(0)] == [(0, (0, 1, 2, 3)), (1, (0, 4))]
    assert [(lv, g.members) for lv, g in layout.path(4)] == [(0, (4, 5, 6, 7)), (1, (0, 4))]
    assert [(lv, g.members) for lv, g in layout.path(5)] == [(0, (4, 5, 6, 7))]
    top = layout.levels[-1][0]
    assert [top.span(i) for i in range(2)] == [(0, 4), (4, 8)]
    assert layout.describe() == "8 ranks: 2 host(s) (4 rank(s) each) -> 1 group(s) (fan-out 2)"


def test_levels_of_fan_out_leaders_up_to_rank_0():
    layout = TreeLayout.build([8] * 1120, 16)  # 8,960 ranks on 8-GPU hosts
    assert [len(lv) for lv in layout.levels] == [1120, 70, 5, 1]
    assert layout.levels[-1][0].members == (0, 128 * 16, 2 * 128 * 16, 3 * 128 * 16, 4 * 128 * 16)
    assert len(layout.path(0)) == 4 and len(layout.path(8)) == 2 and len(layout.path(9)) == 1


def test_host_sizes_from_names_and_blocks():
    assert host_sizes(6, names=["a", "a", "b", "b", "b", "a"]) == [2, 3, 1]  # runs, not sets
    assert host_sizes(8, ranks_per_host=3) == [3, 3, 2]
    assert host_sizes(1, names=["x"]) == [1]
    with pytest.raises(ValueError):
        host_sizes(3, names=["a"])


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=30), st.integers(2, 5))
def test_every_group_spans_contiguous_ranks_and_every_rank_one_path(sizes, fan_out):
    layout = TreeLayout.build(sizes, fan_out)
    ws = layout.world_size
    assert ws == sum(sizes)
    assert len(layout.levels[-1]) == 1 and layout.levels[-1][0].leader == 0
    for lv in layout.levels:
        # the groups of a level partition the ranks; each group's members' spans partition it
        assert [r for g in lv for r in range(g.leader, g.end)] == list(range(ws))
        for g in lv:
            assert list(g.members) == sorted(g.members) and len(g.members) <= max(fan_out, *sizes)
            assert [r for i in range(len(g.members)) for r in range(*g.span(i))] == list(range(g.leader, g.end))
    for r in range(ws):
        path = layout.path(r)
        assert [lv for lv, _ in path] == list(range(len(path)))
        assert all(g.leader == r for _, g in path[:-1])  # a rank goes up only from groups it leads
        assert (path[-1][1].leader == r) == (r == 0)  # only rank 0 leads its top group
        # a member's span one level up is the span of the group it leads below
        for (_, below), (_, above) in zip(path, path[1:]):
            assert above.span(above.members.index(r)) == (below.leader, below.end)


def test_options_validate_and_resolve_from_the_environment(monkeypatch):
    for var in (TREE_MIN_WORLD_SIZE_ENV, TREE_FAN_OUT_ENV, RANKS_PER_HOST_ENV):
        monkeypatch.delenv(var, raising=False)
    shape = CoordinationOptions().resolved()
    assert (shape.min_world_size, shape.fan_out, shape.ranks_per_host) == (512, 16, None)
    assert not shape.uses_tree(511) and shape.uses_tree(512)
    monkeypatch.setenv(TREE_MIN_WORLD_SIZE_ENV, "8")
    monkeypatch.setenv(TREE_FAN_OUT_ENV, "4")
    monkeypatch.setenv(RANKS_PER_HOST_ENV, "2")
    shape = CoordinationOptions().resolved()
    assert (shape.min_world_size, shape.fan_out, shape.ranks_per_host) == (8, 4, 2)
    explicit = CoordinationOptions(tree_min_world_size=100, fan_out=2, ranks_per_host=8).resolved()
    assert (explicit.min_world_size, explicit.fan_out, explicit.ranks_per_host) == (100, 2, 8)  # fields win
    monkeypatch.setenv(TREE_FAN_OUT_ENV, "one")
    with pytest.raises(ValueError, match=TREE_FAN_OUT_ENV):
        CoordinationOptions().resolved()
    for bad in ({"fan_out": 1}, {"ranks_per_host": 0}, {"tree_min_world_size": 1}, {"fan_out": True}):
        with pytest.raises(ValueError, match="CoordinationOptions"):
            CoordinationOptions(**bad)
    monkeypatch.delenv(TREE_FAN_OUT_ENV)
    assert not CoordinationOptions(tree_min_world_size=2).resolved().uses_tree(1)
