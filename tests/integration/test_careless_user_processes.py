"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/test_careless_user.py``, which holds its single-process tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import unickpt

SRC = str(Path(unickpt.__file__).resolve().parents[1])


_TORCHRUN_CHILD = textwrap.dedent(
    """
    import json, os, sys, torch, unickpt
    out = {}
    for op in ("save", "load"):
        try:
            if op == "save":
                unickpt.save(sys.argv[1], {"model": torch.nn.Linear(2, 2)}, framework="torch")
            else:
                unickpt.load(sys.argv[1], {"model": torch.nn.Linear(2, 2)}, framework="torch")
            out[op] = None
        except Exception as e:
            out[op] = [type(e).__name__, str(e)]
    out["written"] = os.path.exists(sys.argv[1])
    print(json.dumps(out))
    """
)


def test_item10_save_and_load_under_torchrun_without_a_process_group_are_refused(tmp_path):
    import json

    env = {**os.environ, "PYTHONPATH": SRC, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    ck = str(tmp_path / "ck")
    proc = subprocess.run(
        [sys.executable, "-c", _TORCHRUN_CHILD, ck], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["written"] is False
    for op in ("save", "load"):
        assert out[op] is not None and out[op][0] == "NoProcessGroupError", out
        msg = out[op][1]
        assert "WORLD_SIZE=2" in msg and "rank 1" in msg and "init_process_group" in msg, msg
