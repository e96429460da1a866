"""bench/three_way.py (issue #30 item 2): its smoke run gives every row of every library, every
load bit-exact; and its bit-exact check does catch a flipped byte. No timing is asserted.

One run of ``--quick`` (tiny sizes, one round, the small case in the big case's processes): 2
fresh ranks per library plus one for its resharding load, so 8 sessions (~2 CPU-seconds of
start-up each: torch's import) -- tens of seconds on 2 cores, more on a loaded machine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCH = os.path.join(ROOT, "bench")

SAVE_LOAD_ROWS = {"first save", "blocking save", "load", "reshard load", "small save", "small load"}
ASYNC_ROWS = {"async call", "async held up", "async written"}


def _load_ranks_module():
    spec = importlib.util.spec_from_file_location("three_way_ranks", os.path.join(BENCH, "_three_way_ranks.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_three_way_quick_run_has_every_row_and_every_load_is_bit_exact(tmp_path):
    out = tmp_path / "three_way.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "three_way.py"), "--quick", "--json", str(out), "--dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    want_libs = ["unickpt", "dcp"] + (["tcp"] if importlib.util.find_spec("torch_checkpointing") else []) + ["raw"]
    assert data["libs"] == want_libs
    for lib in want_libs:
        res = data["results"][lib]
        assert res["failed"] == {}, (lib, res["failed"])
        rows = SAVE_LOAD_ROWS | (set() if lib == "raw" else ASYNC_ROWS)
        assert set(res["times"]) == rows | {"step"}, lib
        assert all(len(res["times"][row]) == 1 for row in rows), lib
        assert {"blocking save", "load", "reshard load", "small load"} <= set(res["mem"]), lib
    assert f"bit-exact: {3 * len(want_libs)} loads checked, 0 failure(s)" in proc.stdout
    assert "FAILED" not in proc.stdout
    assert not list(tmp_path.glob("unickpt-bench-*")), "the run left its checkpoints behind"


def test_three_way_check_catches_one_flipped_byte():
    import crc32c
    import torch

    ranks = _load_ranks_module()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    optim.step()
    want = ranks.digests(model, optim)
    assert ranks.mismatches(ranks.digests(model, optim), want) == []
    # a world of 1 loading what two ranks saved as dim-0 halves (FSDP2's Shard(0)), and the step everyone holds
    halves = [{}, {}]
    for k, t in ranks.local_tensors(model, optim).items():
        for r, piece in enumerate((t[:2], t[2:]) if t.dim() else (t, t)):
            raw = piece.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            halves[r][k] = [list(piece.shape), str(piece.dtype), crc32c.crc32c(raw)]
    assert ranks.reshard_mismatches(model, optim, halves) == []
    with torch.no_grad():
        model.weight.view(torch.uint8).view(-1)[13] ^= 1  # one bit of one byte of the rows rank 0 saved
    assert ranks.mismatches(ranks.digests(model, optim), want) == ["model.weight"]
    assert ranks.reshard_mismatches(model, optim, halves) == ["model.weight"]
