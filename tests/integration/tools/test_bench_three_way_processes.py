"""bench/three_way.py (issue #30 item 2): its smoke run gives every row of every library, every
load bit-exact, and unickpt's load phases; its bit-exact check does catch a flipped byte; and
``--read-cap``'s control group (bench/_read_cap.py) holds the process, counts its reads and is
gone afterwards. No timing is asserted.

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
# peak memory recorded of: the first save (an async save: its staging copy), and every other operation
MEM_OPS = {"first save", "blocking save", "load", "reshard load", "small save", "small load"}


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
        assert set(res["mem"]) == MEM_OPS, lib
    for op in ("load", "reshard load"):  # where each unickpt load's time went, from its events
        (phases,) = data["results"]["unickpt"]["phases"][op]
        assert {"groups", "metadata", "plan", "read", "io", "crc", "total", "cpu"} <= set(phases), op
        assert 0 < phases["read"] <= phases["total"], (op, phases)
        assert f"unickpt {op}, phases (rank 0, medians, s): " in proc.stdout
    # the fresh 1-rank process of the resharding load creates its process groups in the load
    (reshard,) = data["results"]["unickpt"]["phases"]["reshard load"]
    assert reshard["groups"] > 0, reshard
    # a memory row for each operation, the async save's staging copy and the small load included
    for row in ("first save (async: staging copy)", "blocking save", "load", "small save", "small load"):
        line = next((x for x in proc.stdout.splitlines() if x.startswith(f"peak RSS/rank: {row} ")), None)
        assert line is not None and line.count("(+") == len(want_libs), (row, line)
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


CAP_CHILD = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from _read_cap import read_cap
from _common import evict
path, out = sys.argv[2], {}
with read_cap(os.path.dirname(path), 50_000_000) as how:
    group = [l.split(":", 2)[2] for l in open("/proc/self/cgroup") if l.split(":")[1] in ("blkio", "")]
    out.update(how=how, group=group[0].strip())
    evict([path])
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
    root = "/sys/fs/cgroup/blkio" if "v1" in how else "/sys/fs/cgroup"
    out["dir"] = os.path.join(root, out["group"].lstrip("/"))
    stat = "blkio.throttle.io_service_bytes" if "v1" in how else "io.stat"
    out["stat"] = open(os.path.join(out["dir"], stat)).read()
    out["rule"] = open(os.path.join(out["dir"], "blkio.throttle.read_bps_device" if "v1" in how else "io.max")).read()
out["after"] = open("/proc/self/cgroup").read()
print(json.dumps(out))
"""


def test_read_cap_holds_the_process_counts_its_reads_and_leaves_nothing(tmp_path):
    import pytest

    spec = importlib.util.spec_from_file_location("read_cap", os.path.join(BENCH, "_read_cap.py"))
    cap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cap)
    if os.geteuid() != 0:
        pytest.skip("--read-cap needs root")
    try:
        disk = cap.disk_of(str(tmp_path))
    except SystemExit as e:
        pytest.skip(str(e))
    controllers = "/sys/fs/cgroup/cgroup.controllers"
    has_v2 = os.path.exists(controllers) and "io" in open(controllers).read().split()
    if not has_v2 and not os.path.isdir("/sys/fs/cgroup/blkio"):
        pytest.skip("no block-I/O control group here")
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(4 << 20))
    proc = subprocess.run(
        [sys.executable, "-c", CAP_CHILD, BENCH, str(data)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["group"].endswith("/unickpt-bench-" + str(out["group"].rsplit("-", 1)[1]))
    assert disk in out["rule"] and "50000000" in out["rule"], out["rule"]
    # the 4 MiB read from the disk went through the group (v1: "<disk> Read N"; v2: "<disk> rbytes=N")
    line = next(x for x in out["stat"].splitlines() if x.startswith(disk) and ("Read" in x or "rbytes" in x))
    read = int(line.split()[-1]) if "Read" in line else int(line.split("rbytes=")[1].split()[0])
    assert read >= 4 << 20, out["stat"]
    assert "unickpt-bench-" not in out["after"]  # moved back where it was
    assert not os.path.exists(out["dir"])  # and the group removed
