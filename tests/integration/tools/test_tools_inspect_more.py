"""``unickpt inspect`` deeper views (issue 15): --key filter, --shards, --values, bytes per rank,
non-tensor state. Expected numbers come from the golden checkpoint's closed formula."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.fixtures.golden_v1 import GOLDEN, expected_fsdp2_ws3


def _inspect(*args: str) -> subprocess.CompletedProcess[str]:
    path = os.path.join(GOLDEN, "v1_fsdp2_ws3")
    return subprocess.run(
        [sys.executable, "-m", "unickpt.cli", "inspect", path, *args], capture_output=True, text=True, timeout=120
    )


def test_issue15_inspect_key_filter_shards_values_and_ranks():
    r = _inspect("--key", r"^model\.a\.", "--shards", "model.a.weight", "--values", "model.a.weight")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    tensor_rows = [ln.split()[0] for ln in out.split("tensors (")[1].split("files (")[0].splitlines()[2:] if ln.strip()]
    assert sorted(tensor_rows) == ["model.a.bias", "model.a.weight"], tensor_rows
    assert "shards of model.a.weight (float32, shape [5, 7], 3 shards)" in out
    want = expected_fsdp2_ws3()["model.a.weight"].reshape(-1)
    assert f"first 10: {want[:10].tolist()}" in out
    assert f"min {float(want.double().min()):.6g}  max {float(want.double().max()):.6g}" in out
    assert "bytes per saving rank:" in out and "extra state     3 per-rank blob(s)" in out
    missing = _inspect("--values", "model.nope")
    assert missing.returncode == 0 and "no tensor 'model.nope'" in missing.stdout
