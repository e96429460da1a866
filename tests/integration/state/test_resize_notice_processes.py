"""Issue 39 item 19 on real gloo ranks: the warning after a change of world size fires only when
ranks now share per-rank values that differed, and names them (``state.resize_notice``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.workers.harness import calls_in_turn, run_ranks
from tests.workers.resize_notice_workers import load_warnings, save_alike_and_per_rank


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("resize_notice")
    alike, differ = str(tmp / "alike"), str(tmp / "differ")
    run_ranks(save_alike_and_per_rank, 2, alike, differ)
    out: dict[str, Any] = {}
    for ws in (1, 3):
        got = run_ranks(calls_in_turn, ws, [[load_warnings, [alike]], [load_warnings, [differ]]])
        out[f"alike_ws{ws}"] = [r[0] for r in got]
        out[f"differ_ws{ws}"] = [r[1] for r in got]
    return out


def _resize_warnings(results: list[dict]) -> list[str]:
    return [w for r in results for w in r["warnings"] if "extra_state" in w]


def test_issue39_item19_resize_warning_only_when_ranks_share_differing_state(loads: dict[str, Any]) -> None:
    # every rank saved the same extra_state (no RNG state): nothing is shared that differed
    assert [r["step"] for r in loads["alike_ws3"]] == [100, 100, 100]
    assert _resize_warnings(loads["alike_ws3"]) == []
    assert _resize_warnings(loads["alike_ws1"]) == [] and _resize_warnings(loads["differ_ws1"]) == []
    # each rank's own RNG state, restored on 3 ranks: one warning (rank 0), naming the RNG entry only
    shared = _resize_warnings(loads["differ_ws3"])
    assert len(shared) == 1, shared
    assert "extra_state['rng']" in shared[0] and "'step'" not in shared[0], shared[0]
    assert "RNG" not in shared[0]  # it names the entry, it does not guess what it holds
