"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/format/test_keymap.py``, which holds its single-process tests."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import unickpt
from tests.unit.format.test_keymap import New, Old, _same_training_state, _trained


def test_issue15_modify_renames_drops_and_casts_into_a_new_checkpoint(tmp_path):
    old, old_opt = _trained(Old, 2)
    src = str(tmp_path / "src")
    unickpt.save(src, {"model": old, "optimizer": old_opt})
    before = sorted(os.listdir(src))
    cli = [sys.executable, "-m", "unickpt.cli", "modify", src]
    r = subprocess.run(
        [*cli, str(tmp_path / "renamed"), "--rename", r"\.enc\.=.encoder.", "--rename", r"\.head\.=.out."],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    new, new_opt = _trained(New, 3)
    unickpt.load(str(tmp_path / "renamed"), {"model": new, "optimizer": new_opt}, strict=True)
    assert _same_training_state(old, old_opt, new, new_opt)
    r = subprocess.run(
        [*cli, str(tmp_path / "model_bf16"), "--drop", r"^optimizer\.", "--dtype", "bf16"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    half = Old().to(torch.bfloat16)
    unickpt.load(str(tmp_path / "model_bf16"), {"model": half}, strict=True)
    for k, v in old.state_dict().items():
        assert torch.equal(half.state_dict()[k], v.to(torch.bfloat16)), k
    assert sorted(os.listdir(src)) == before  # the source is never changed
