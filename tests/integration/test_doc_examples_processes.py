"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/test_doc_examples.py``, which holds its single-process tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests import workers
from tests.unit.test_doc_examples import REPO, snippets

OLD_MANAGER_LOOP = """\
manager = unickpt.CheckpointManager("ckpts", keep_last=3)
start = manager.load_latest(state, framework="fsdp2")     # None on a fresh start
for step in range(start or 0, steps):
    train_step(step)
    if step % 100 == 0:
        manager.save(step, state, framework="fsdp2", async_save=True)
manager.wait()
"""


def test_doc_examples_run(tmp_path):
    docs = snippets()
    planted = [
        {"name": "planted:raises", "code": "unickpt.load('does-not-exist', state)\n", "kind": "run"},
        {"name": "planted:old-resume-loop", "code": OLD_MANAGER_LOOP, "kind": "resume"},
    ]
    path, out = tmp_path / "snippets.json", tmp_path / "results.json"
    path.write_text(json.dumps(docs + planted))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(os.path.dirname(workers.__file__), "doc_examples_worker.py"),
            str(path),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    broken = {name: err for name, err in results.items() if err is not None and not name.startswith("planted:")}
    assert not broken, "\n\n".join(f"{name}:\n{err}" for name, err in broken.items())
    assert sorted(results) == sorted(s["name"] for s in docs + planted)
    assert "NotACheckpointError" in (results["planted:raises"] or "")
    assert "differs from the uninterrupted one" in (results["planted:old-resume-loop"] or ""), results
