"""torchtitan's ``keep_latest_k`` deletes only unickpt's own files of a purged ``step-N`` folder
(``folder.cleanup.delete_checkpoint``): a user's file in the folder, or beside unickpt's data
files, stays. One process."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torchtitan.components.checkpointer")
pytest.importorskip("triton")  # torchtitan's models import it (its CPU install lacks it otherwise)


from tests.workers.torchtitan_workers import build, train_step


def test_keep_latest_k_leaves_the_users_files_in_a_purged_step(tmp_path) -> None:
    t = build(str(tmp_path), interval=1, keep_latest_k=2)
    folder = os.path.join(str(tmp_path), "checkpoint")
    train_step(t)  # saves step-1
    step1 = os.path.join(folder, "step-1")
    (data,) = os.listdir(os.path.join(step1, "data"))  # the save's data folder
    with open(os.path.join(step1, "notes.txt"), "w") as f:
        f.write("the user's")
    with open(os.path.join(step1, "data", data, "mine.bin"), "w") as f:
        f.write("the user's too")
    train_step(t)
    train_step(t)  # step-3: keep_latest_k=2 purges step-1
    t["manager"].close()
    assert sorted(os.listdir(folder)) == ["step-1", "step-2", "step-3"]
    left = sorted(os.path.relpath(os.path.join(d, f), step1) for d, _, fs in os.walk(step1) for f in fs)
    assert left == [os.path.join("data", data, "mine.bin"), "notes.txt"]
