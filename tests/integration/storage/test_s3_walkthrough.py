"""The S3 walk-through of docs/guide/storage.md works as written, against a real SeaweedFS.

Its Python block runs in a fresh process with the endpoint and credentials in the standard AWS
variables (as step 2 of the walk-through sets them), on a bucket of its own; then the shell
commands of step 4 run through the installed entry point's module (``python -m unickpt``). The
expected listing comes from the walk-through's own numbers (3 saves, ``keep_last=2``)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys

from tests.fixtures.s3server import require_s3_clients

require_s3_clients()

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
GUIDE = os.path.join(REPO, "docs", "guide", "storage.md")


def walkthrough() -> tuple[str, list[str]]:
    """The walk-through's Python block and its ``unickpt`` shell commands."""
    text = open(GUIDE).read()
    part = text[text.index("## Walk-through") :]
    part = part[: part.index("\n## ", 1)]
    code = re.search(r"^```python\n(.*?)^```", part, re.S | re.M).group(1)
    commands = [line.split("#")[0].split() for line in part.splitlines() if line.startswith("unickpt ")]
    return code, commands


def test_s3_walkthrough_of_the_storage_guide_runs(s3_server, tmp_path):
    code, commands = walkthrough()
    assert [c[:2] for c in commands] == [
        ["unickpt", "ls"],
        ["unickpt", "latest"],
        ["unickpt", "verify"],
        ["unickpt", "inspect"],
    ]
    bucket = f"walk-{secrets.token_hex(4)}"
    code = code.replace('"ckpts"', f'"{bucket}"').replace("s3://ckpts/", f"s3://{bucket}/")
    env = dict(os.environ, **s3_server.endpoint.env())
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "src"), env.get("PYTHONPATH", "")])
    script = tmp_path / "walk.py"
    script.write_text(code)
    try:
        run = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        out = {}
        for cmd in commands:
            args = [a.replace("s3://ckpts/", f"s3://{bucket}/") for a in cmd[1:]]
            proc = subprocess.run(
                [sys.executable, "-m", "unickpt", *args], capture_output=True, text=True, env=env, timeout=300
            )
            assert proc.returncode == 0, (cmd, proc.stdout, proc.stderr)
            out[cmd[1]] = proc.stdout
        assert "step_00000002" in out["ls"] and "step_00000003" in out["ls"] and "step_00000001" not in out["ls"]
        assert "step_00000003" in out["latest"]
    finally:
        s3_server.delete_bucket(bucket)
