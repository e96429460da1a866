"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/ops/test_pieces.py``, which holds its single-process tests."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import unickpt
from unickpt.format import METADATA_FILE

MiB = 1 << 20


def _forge_8gib(src: Path) -> tuple[str, str]:
    """Rewrite the metadata of the one-tensor checkpoint ``src`` so that its tensor claims
    8 GiB (shape, shard, recorded file size and one checksum per chunk all consistent): the
    decoder accepts it, the data file holds 64 bytes. Returns (key, data file name)."""
    md = json.loads((src / METADATA_FILE).read_text())
    (key,) = md["tensors"]
    n = 1 << 31  # float32: 8 GiB
    md["tensors"][key]["shape"] = [n]
    md["tensors"][key]["shards"] = [[0, n, 0, 0]]
    sums = md["checksums"]
    assert len(md["files"]) == 1
    sums["file_sizes"] = [4 * n]
    sums["crcs"] = base64.b64encode(b"\0\0\0\0" * (4 * n // sums["chunk_size"])).decode()
    (src / METADATA_FILE).write_text(json.dumps(md))
    return key, md["files"][0]


# One child process serves both memory tests (one import of torch): it merges a 64 MiB tensor
# with 2 MiB pieces, measuring its own peak RSS (VmHWM, reset after the imports through
# /proc/self/clear_refs), then caps its address space at 3 GiB above its size and runs every
# command on the checkpoint whose metadata claims 8 GiB.
_CHILD = textwrap.dedent(
    """
    import contextlib, io, json, resource, sys
    from unickpt import cli
    import unickpt.ops.merge

    def status(key):
        return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith(key))

    plan = json.loads(sys.argv[1])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status("VmRSS:")
    merged = cli.main(plan["measure"])
    peak = status("VmHWM:")
    cap = status("VmSize:") + (3 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    capped = []
    for args in plan["capped"]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = cli.main(args)
            except BaseException as e:
                code = repr(e)
        capped.append([code, err.getvalue()])
    print(json.dumps({"merged": merged, "before": before, "peak": peak, "capped": capped}))
    """
)


@pytest.fixture(scope="module")
def child_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("memory")
    torch.manual_seed(0)
    big = torch.randn(64 * MiB // 4 // 1024, 1024)
    unickpt.save(str(tmp / "big"), {"model": torch.nn.ParameterDict({"w": torch.nn.Parameter(big)})})
    forged = tmp / "forged"
    unickpt.save(str(forged), {"model": torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.ones(16))})})
    key, data = _forge_8gib(forged)
    capped = [
        ["merge", str(forged), str(tmp / "o1")],
        ["merge", str(forged), str(tmp / "o2"), "--format", "torch"],
        ["modify", str(forged), str(tmp / "o3")],
        ["diff", str(forged), str(forged)],
        ["inspect", str(forged), "--values", key],
    ]
    plan = {"measure": ["merge", str(tmp / "big"), str(tmp / "merged"), "--piece-size", "2MiB"], "capped": capped}
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(plan)], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stderr
    result: dict[str, Any] = json.loads(r.stdout.splitlines()[-1])
    result.update(tmp=tmp, big=big, data=data, commands=capped)
    return result


def test_merge_peak_memory_is_bounded_by_the_piece_not_the_tensor(child_run: dict[str, Any]) -> None:
    """A 64 MiB tensor merged with 2 MiB pieces: peak RSS stays under 24 MiB above the RSS
    before the merge (reading it whole needs 64 MiB more); the output is the tensor, bit for bit."""
    assert child_run["merged"] == 0
    extra = child_run["peak"] - child_run["before"]
    assert extra < 24 * MiB, (extra / MiB, child_run["before"] / MiB)
    with safe_open(str(child_run["tmp"] / "merged" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.w"), child_run["big"])


def test_a_forged_8gib_claim_is_refused_before_allocating(child_run: dict[str, Any]) -> None:
    """Under an address-space cap of 3 GiB above the process's size, merge (both formats),
    modify, diff and inspect --values each refuse the 8 GiB claim with one line naming the data
    file and the claimed size (before: an 8 GiB allocation, a raw allocator error under the
    cap), and write nothing."""
    for args, (code, err) in zip(child_run["commands"], child_run["capped"]):
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1, (args, code, err)
        assert "TruncatedDataFileError" in lines[0] and os.path.basename(child_run["data"]) in lines[0], (args, err)
        assert str(8 << 30) in lines[0], (args, err)  # the claimed size in bytes
    assert not any((child_run["tmp"] / o).exists() for o in ("o1", "o2", "o3"))
