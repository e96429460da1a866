"""Issue 39 item 15: ``merge`` and ``convert --to dcp`` on a full disk or interrupted late.

A full disk is a real tmpfs of 1 MiB (``mount -t tmpfs -o size=1m``; skipped where mounting is not
allowed), the command a real ``unickpt`` process. Expected: one stderr line naming the file that
did not fit, and nothing left in OUT (today: ``OSError ... unexpected`` without a name, or
``enforce fail at inline_container.cc``, and a partial ``__0_0.distcp`` / ``checkpoint.pt``).

An interrupt is a real SIGINT or SIGKILL sent to the command once its first data file appears on
disk (under any name: the test waits for the file, not for a time). Expected: no file under a
final name that is not complete (after SIGINT nothing at all, exit 130 and one line; after SIGKILL
only temporary names). Today DCP writes ``__0_0.distcp`` in place, so a kill leaves it without
``.metadata``, and a SIGINT in a multi-file merge leaves the files already written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import unickpt

CLI = [sys.executable, "-m", "unickpt.cli"]
PARTIAL = ".unickpt-partial"  # unickpt's temporary names (a suffix, and DCP's staging folder)

COMMANDS = {
    "convert-dcp": ["convert", "--to", "dcp"],
    "merge-safetensors": ["merge", "--max-shard-size", "40MB"],
    "merge-torch": ["merge", "--format", "torch"],
}


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem of 1 MiB: writing more fails with ENOSPC."""
    where = tmp_path / "disk"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of ~100 MB in 3 tensors (writing it takes long enough to be interrupted)."""
    path = tmp_path_factory.mktemp("src") / "ck"
    torch.manual_seed(0)
    model = torch.nn.ParameterDict({f"w{i}": torch.nn.Parameter(torch.randn(1024, 8192)) for i in range(3)})
    unickpt.save(str(path), {"model": model})
    return path


def _final_names(out: Path) -> list[str]:
    """The files in OUT under a final name (not unickpt's temporaries)."""
    if not out.exists():
        return []
    return sorted(n for n in os.listdir(out) if not n.endswith(PARTIAL) and n != PARTIAL)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_issue39_item15_full_disk_names_the_file_and_leaves_nothing(tiny_disk, big_checkpoint, command):
    out = tiny_disk / "out"
    r = subprocess.run([*CLI, *COMMANDS[command], str(big_checkpoint), str(out)], capture_output=True, text=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "StorageError" in lines[0] and "disk full" in lines[0], lines[0]
    assert f"{out}{os.sep}" in lines[0], lines[0]  # names the file inside OUT that did not fit
    assert "unexpected" not in lines[0] and "inline_container" not in lines[0], lines[0]
    assert not out.exists() or os.listdir(out) == [], os.listdir(out)
    assert os.statvfs(tiny_disk).f_bfree == os.statvfs(tiny_disk).f_blocks  # the space is given back


def _data_file_appears(out: Path, proc: subprocess.Popen[str], second: bool) -> bool:
    """Wait until a data file of the command exists below OUT (under any name; ``second``: the
    second safetensors file of a multi-file merge, so the first is complete); False if the
    command ended first."""
    markers = (".distcp", ".pt", ".safetensors")
    while proc.poll() is None:
        for _, _, files in os.walk(out):
            names = [n.removesuffix(PARTIAL) for n in files]
            if any(n.endswith(markers) and (not second or "00002-of" in n) for n in names):
                return True
        time.sleep(0.002)  # between two looks at the folder: the wait is for the file
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_issue39_item15_interrupted_command_leaves_no_partial_file(tmp_path, big_checkpoint, command, sig):
    if command == "merge-safetensors" and sig == signal.SIGKILL:
        pytest.skip("each safetensors file is renamed when complete already: a kill leaves only complete ones")
    out = tmp_path / "out"
    args = [*CLI, *COMMANDS[command], str(big_checkpoint), str(out)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = _data_file_appears(out, proc, second=command == "merge-safetensors")
    if started:
        proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=300)
    if not started or proc.returncode == 0:  # done before the signal: then the output must be whole
        assert proc.returncode == 0, stderr
        pytest.skip("the command finished before it could be interrupted")
    final = _final_names(out)
    assert final == [], f"final-named files left after {sig.name}: {final}"
    if sig == signal.SIGINT:
        lines = [line for line in stderr.strip().splitlines() if ": wrote " not in line]  # merge's progress
        assert proc.returncode == 130 and lines == [f"unickpt {COMMANDS[command][0]}: interrupted"], stderr
        assert os.listdir(out) == [], os.listdir(out)  # the temporaries are removed too
