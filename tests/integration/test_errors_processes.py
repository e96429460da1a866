"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/test_errors.py``, which holds its single-process tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import unickpt
from tests.unit.test_errors import assert_same, snapshot
from unickpt.errors import IncompleteCheckpointError

_CRASH = textwrap.dedent("""
    import os, sys, torch
    import unickpt
    from unickpt.folder.publish import RenamePublisher

    def crash(self, name, data):
        os._exit(17)  # the process dies: no cleanup, no exception handling

    RenamePublisher.publish = crash
    torch.manual_seed(int(sys.argv[2]))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    unickpt.save(sys.argv[1], {"model": model, "extra_state": {"step": 2}}, framework="torch")
    sys.exit(0)  # not reached
""")


def test_crash_before_commit_in_subprocess(tmp_path: Path) -> None:
    """os._exit during the commit: the old checkpoint loads bit-exactly; a fresh path is incomplete."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    want = snapshot(model)
    old, fresh = tmp_path / "old", tmp_path / "fresh"
    unickpt.save(str(old), {"model": model}, framework="torch").wait()
    for path in (old, fresh):
        proc = subprocess.run(
            [sys.executable, "-c", _CRASH, str(path), "2"], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 17, proc.stderr
    target = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    unickpt.load(str(old), {"model": target}, framework="torch")
    assert_same(target, want)
    assert any((fresh / "data").rglob("*.bin"))
    with pytest.raises(IncompleteCheckpointError, match=str(fresh)):
        unickpt.load(str(fresh), {"model": target}, framework="torch")
