"""Issue 39 item 9, real gloo ranks: lists of Statefuls under one key (``"lr_scheduler":
[sched0, sched1]``, a list of user trackers holding DTensors) saved by 2 ranks once (replicated,
claimed equal on every rank) and loaded by 3 ranks and by 1 (the test process), tensors
resharded; a list of another length is refused naming the key. One spawn per world size."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.workers.harness import run_ranks
from tests.workers.stateful_list_workers import STEPS, build, load, save_ws2, snapshot, train


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("stateful_lists"))
    return root, run_ranks(save_ws2, 2, root)


def _reference(steps: int) -> dict[str, Any]:
    """An uninterrupted run in this process (no process group: plain tensors)."""
    state = build()
    train(state, steps)
    return snapshot(state)


def test_issue39_item9_lists_saved_once_by_2_ranks(saved):
    root, out = saved
    with open(os.path.join(root, "ckpt", "unickpt.metadata.json")) as f:
        md = json.load(f)
    blobs = set(md["blobs"])
    assert {"lr_scheduler/replicated", "trackers/replicated"} <= blobs
    assert not any(b.startswith(("lr_scheduler/rank", "trackers/rank")) for b in blobs)  # once, not per rank
    assert md["objects"]["state_encoding"]["lists"] == {"lr_scheduler": 2, "trackers": 2}
    assert {"trackers.0.sums", "trackers.1.sums"} <= set(md["tensors"])
    want = _reference(STEPS)
    for r in out:
        assert r["saved"] == {**want, "sums_types": ["DTensor", "DTensor"]}
        assert "'lr_scheduler'" in r["refused"] and "rank 0" in r["refused"] and "rank 1" in r["refused"]


@pytest.mark.parametrize("ws", [1, 3])
def test_issue39_item9_lists_saved_by_2_ranks_load_at_another_world_size(saved, ws):
    root, _ = saved
    results = [load(0, 1, root)] if ws == 1 else run_ranks(load, 3, root)
    kind = "Tensor" if ws == 1 else "DTensor"
    for r in results:
        assert r["loaded"] == {**_reference(STEPS), "sums_types": [kind, kind]}
        assert r["next"] == {**_reference(STEPS + 1), "sums_types": [kind, kind]}  # resumes as the run goes on
        assert "state['lr_scheduler']" in r["short"] and "list of 2" in r["short"] and "list of 1" in r["short"]
