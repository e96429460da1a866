"""``unickpt diff``, ``ls``, ``latest``, ``prune`` (issue 15)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn

import unickpt

CLI = [sys.executable, "-m", "unickpt.cli"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def test_issue15_diff_names_what_differs(tmp_path):
    m = _model(0)
    a, b, c = (str(tmp_path / n) for n in "abc")
    unickpt.save(a, {"model": m})
    unickpt.save(b, {"model": m}, options=unickpt.SaveOptions(files_per_rank=2))  # other layout, same values
    with torch.no_grad():
        m[2].bias[1] += 0.5
    unickpt.save(c, {"model": m, "extra_state": {"x": 1}})
    same = _cli("diff", a, b)
    assert same.returncode == 0 and "identical: 4 tensors equal" in same.stdout, same.stdout + same.stderr
    changed = _cli("diff", a, c)
    assert changed.returncode == 1, changed.stdout
    lines = [ln for ln in changed.stdout.splitlines() if ln.startswith("differs")]
    assert lines == ["differs (values): model.2.bias: 1 of 3 elements differ, max |a-b| 0.5"], changed.stdout


def test_issue15_ls_latest_prune(tmp_path):
    root = str(tmp_path / "run")
    manager = unickpt.CheckpointManager(root, keep_last=None)
    m = _model(1)
    for step in (10, 20, 30):
        manager.save(step, {"model": m})
    os.makedirs(os.path.join(root, "notes"))
    with open(os.path.join(root, "notes", "mine.txt"), "w") as f:
        f.write("keep")
    ls = _cli("ls", root)
    assert ls.returncode == 0 and ls.stdout.count("step ") == 3 and "<- latest" in ls.stdout.splitlines()[-1]
    latest = _cli("latest", root)
    assert latest.returncode == 0 and latest.stdout.strip() == manager.path_for(30)
    pruned = _cli("prune", root, "--keep-last", "1")
    assert pruned.returncode == 0 and "steps [10, 20]" in pruned.stdout, pruned.stdout + pruned.stderr
    assert [c.step for c in manager.list_checkpoints()] == [30]
    assert open(os.path.join(root, "notes", "mine.txt")).read() == "keep"
    empty = _cli("latest", str(tmp_path / "nothing"))
    assert empty.returncode in (1, 2)
