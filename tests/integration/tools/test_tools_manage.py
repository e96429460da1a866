"""``unickpt diff``, ``ls``, ``latest``, ``prune`` (issue 15)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
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
    assert lines == [  # c also saved the key extra_state: the state_keys object differs (issue 27)
        "differs (values): model.2.bias: 1 of 3 elements differ, max |a-b| 0.5",
        "differs (object): state_keys",
    ], changed.stdout


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


SUBCOMMANDS = ("inspect", "verify", "merge", "convert", "modify", "diff", "ls", "latest", "prune", "report")


def test_issue15_every_subcommand_has_help_and_a_clear_error_on_a_wrong_path(tmp_path, capsys):
    """In-process through ``cli.main`` (one subprocess below checks the installed entry point)."""
    from unickpt.cli import main

    for cmd in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exit_:
            main([cmd, "--help"])
        assert exit_.value.code == 0 and "usage: unickpt" in capsys.readouterr().out, cmd
    nowhere = str(tmp_path / "nowhere")
    out = str(tmp_path / "out")
    for args in (
        ("inspect", nowhere),
        ("verify", nowhere),
        ("merge", nowhere, out),
        ("convert", "--from", "dcp", nowhere, out),
        ("convert", "--from", "hf", nowhere, out),
        ("convert", "--to", "dcp", nowhere, out),
        ("modify", nowhere, out),
        ("diff", nowhere, nowhere),
        ("report", nowhere),
    ):
        code = main(list(args))
        err = capsys.readouterr().err
        assert code == 1 and "error:" in err and "Traceback" not in err, (args, err)
    r = _cli("inspect", nowhere)
    assert r.returncode == 1 and "error:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = _cli("prune", "--help")
    assert r.returncode == 0 and "usage: unickpt" in r.stdout


def test_issue15_ls_shows_sizes_and_incomplete_steps(tmp_path):
    root = str(tmp_path / "run")
    manager = unickpt.CheckpointManager(root, keep_last=None)
    manager.save(5, {"model": _model(2)})
    os.makedirs(os.path.join(root, "step_00000009", "data"))
    with open(os.path.join(root, "step_00000009", "unickpt.data.20991231T000000-aaaaaaaaaaaa"), "w"):
        pass
    r = _cli("ls", root)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stdout
    assert "step          5" in lines[0] and "B" in lines[0] and "<- latest" in lines[0]
    assert "step          9" in lines[1] and "incomplete" in lines[1]


def test_issue39_item18_ls_of_the_readmes_folders_and_an_hf_output_dir(tmp_path):
    """The README's ``unickpt.save("ckpts/step_100")`` and an HF Trainer ``output_dir``: ``unickpt ls``
    (its own process) lists the checkpoints below instead of "no checkpoint under"."""
    unickpt.save(str(tmp_path / "ckpts" / "step_100"), {"model": _model(0)})
    unickpt.save(str(tmp_path / "out" / "checkpoint-8" / "unickpt"), {"model": _model(1)})
    r = _cli("ls", str(tmp_path / "ckpts"))
    assert r.returncode == 0 and r.stdout.strip().endswith(f"{tmp_path}/ckpts/step_100"), r.stdout + r.stderr
    r = _cli("ls", str(tmp_path))
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stdout + r.stderr
    assert lines[0].endswith("ckpts/step_100") and lines[1].endswith("out/checkpoint-8/unickpt"), lines
    r = _cli("inspect", str(tmp_path / "out" / "checkpoint-8"))
    assert r.returncode == 1 and f"{tmp_path}/out/checkpoint-8/unickpt: pass that path" in r.stderr, r.stderr
