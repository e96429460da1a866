"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/cli/test_cli.py``, which holds its single-process tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.cli.test_cli import (
    DEMO,
    saved,  # noqa: F401 (a fixture)
)
from unickpt import cli
from unickpt.format import METADATA_FILE, Metadata, decode_metadata


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "unickpt", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_python_m_inspect_json(saved: tuple[Path, Metadata]) -> None:  # noqa: F811 (a fixture)
    path, md = saved
    proc = run_cli("inspect", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["totals"]["tensors"] == len(md.tensors)


@pytest.mark.parametrize("case", ["empty", "unrelated", "incomplete"])
def test_inspect_error_exits(tmp_path: Path, saved: tuple[Path, Metadata], case: str) -> None:  # noqa: F811 (a fixture)
    path = tmp_path / "x"
    path.mkdir()
    if case == "unrelated":
        (path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    if case == "incomplete":
        src, md = saved
        (path / "data").mkdir()
        (path / md.files[0]).parent.mkdir(parents=True)
        (path / md.files[0]).write_bytes((src / md.files[0]).read_bytes())
    proc = run_cli("inspect", str(path), "--json")
    expected = "IncompleteCheckpointError" if case == "incomplete" else "NotACheckpointError"
    assert proc.returncode == cli.EXIT_ERROR
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"unickpt inspect: error: {expected}: {path}")
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_console_script(saved: tuple[Path, Metadata]) -> None:  # noqa: F811 (a fixture)
    script = Path(sys.executable).parent / "unickpt"
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    proc = subprocess.run(
        [str(script), "inspect", str(saved[0]), "--summary"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "framework torch" in proc.stdout


def test_demo_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    args = ["--out", str(out), "--steps", "2", "--save-every", "2", "--extra-steps", "1", "--dim", "36"]
    args += ["--layers", "2", "--timeout", "150"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resharding 4 -> 2: OK" in proc.stdout
    assert "bit-identical to the saved state" in proc.stdout and "DIFFERENT" not in proc.stdout
    loss_lines = [x for x in proc.stdout.splitlines() if x.strip().startswith("2 ")]
    assert len(loss_lines) == 1 and loss_lines[0].endswith("identical")  # the one resumed step
    assert (out / "step_2" / METADATA_FILE).exists()
    md = decode_metadata((out / "step_2" / METADATA_FILE).read_bytes())
    assert md.topology.framework == "fsdp2" and md.topology.world_size == 4
