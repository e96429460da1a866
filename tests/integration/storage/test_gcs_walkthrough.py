"""The Google Cloud Storage walk-through of docs/guide/storage.md works as written, against the
emulator the tests start (fake-gcs-server): its Python block runs in a fresh process with
``STORAGE_EMULATOR_HOST`` set (step 2), then ``unickpt ls`` and ``verify`` of step 4. The
expected listing comes from the walk-through's own numbers (3 saves, ``keep_last=2``)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
GUIDE = os.path.join(REPO, "docs", "guide", "storage.md")


def test_gcs_walkthrough_of_the_storage_guide_runs(gcs_server, tmp_path):
    text = open(GUIDE).read()
    part = text[text.index("## Walk-through: checkpoints on Google Cloud Storage") :]
    part = part[: part.index("\n## ", 1)]
    code = re.search(r"^```python\n(.*?)^```", part, re.S | re.M).group(1)
    bucket = f"walk-{secrets.token_hex(4)}"
    code = code.replace('"ckpts"', f'"{bucket}"').replace("gs://ckpts/", f"gs://{bucket}/")
    env = dict(os.environ, STORAGE_EMULATOR_HOST=gcs_server.url)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "src"), env.get("PYTHONPATH", "")])
    script = tmp_path / "walk.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "unickpt", *args], capture_output=True, text=True, env=env, timeout=300
        )

    ls = cli("ls", f"gs://{bucket}/run1")
    assert ls.returncode == 0, ls.stdout + ls.stderr
    assert "step_00000002" in ls.stdout and "step_00000003" in ls.stdout and "step_00000001" not in ls.stdout
    assert cli("verify", f"gs://{bucket}/run1/step_00000003").returncode == 0
