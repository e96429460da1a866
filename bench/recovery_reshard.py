"""Resharding from RAM after a lost host (issue 40, item 4), in one run.

    python bench/recovery_reshard.py            # 1 GiB state, 4 hosts -> 3, 3 rounds
    python bench/recovery_reshard.py --quick    # 64 MiB

Set-up: ``--hosts`` simulated hosts, one gloo rank each (``UNICKPT_HOST_ID`` = ``h<rank>``,
``UNICKPT_SHM_ROOT`` = a folder of its own under /dev/shm: its "RAM"); the state is ``--gib`` GiB
of fp32 tensors (16 DTensors sharded by rows; values a function of the position, so that any
layout checks them bit for bit). ``TieredCheckpointManager("shm://job", <disk folder>,
replicas=1, keep_fast=2, durable_every=1)`` saves step 1 (so the durable folder holds a complete
copy too). Then rounds of two arms in alternating order, each on fresh processes:

* ``ram``: host ``h<hosts-1>``'s RAM is gone for good and the job restarts on one host fewer
  (``hosts - 1`` ranks, the rows resharded): ``load_latest`` from the remaining hosts' RAM;
* ``disk``: the same ``hosts - 1`` ranks run a plain ``unickpt.load`` of the complete copy in the
  durable folder (on the local disk, in the page cache after the first round): the ordinary
  resharding load of a checkpoint every rank can see.

Reported: each arm's load wall (slowest rank; median over rounds), the ratio, the recovery's
bytes by source, and the bytes in each host's RAM folder after the recovery against before it
(a recovery that copied the whole checkpoint into every host's RAM shows here). Compare trees by
running this script with ``PYTHONPATH=<tree>/src`` alternately.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_line, median, progress, spawn, table

N_TENSORS = 16
COLS = 1024
GiB = 1 << 30


def _state(ws: int, rows: int):
    import torch
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    module = torch.nn.Module()
    for i in range(N_TENSORS):
        local = torch.zeros(rows // ws, COLS)
        dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        module.register_parameter(f"w{i:02d}", torch.nn.Parameter(dt, requires_grad=False))
    return module


def _expected(rank: int, ws: int, rows: int, i: int):
    import torch

    per = rows // ws
    lo = rank * per * COLS
    return torch.arange(lo, lo + per * COLS, dtype=torch.float64).reshape(per, COLS).float() + i


def _enter(cfg: dict, rank: int) -> None:
    os.environ["UNICKPT_HOST_ID"] = f"h{rank}"
    os.environ["UNICKPT_SHM_ROOT"] = os.path.join(cfg["base"], "ram", f"h{rank}")


def _tiers(cfg: dict):
    import unickpt

    return unickpt.TieredCheckpointManager(
        "shm://job", cfg["durable"], replicas=1, keep_fast=2, durable_every=1, flush_on_sigterm=False, timeout=600.0
    )


def save_main(rank: int, ws: int, cfg: dict) -> None:
    import torch

    torch.set_num_threads(1)
    _enter(cfg, rank)
    module = _state(ws, cfg["rows"])
    for i, p in enumerate(module.parameters()):
        p.to_local().copy_(_expected(rank, ws, cfg["rows"], i))
    tiers = _tiers(cfg)
    tiers.save(1, {"model": module}, async_save=True).wait_snapshot()
    tiers.wait()
    tiers.close()


def load_main(rank: int, ws: int, cfg: dict, arm: str) -> dict:
    import torch
    import torch.distributed as dist

    import unickpt
    import unickpt.engine.load.pipeline  # imported before the clock

    torch.set_num_threads(1)
    _enter(cfg, rank)
    module = _state(ws, cfg["rows"])
    state = {"model": module}
    out: dict = {}
    tiers = _tiers(cfg) if arm == "ram" else None
    dist.barrier()
    t0 = time.perf_counter()
    if tiers is not None:
        step = tiers.load_latest(state)
        out["wall"] = time.perf_counter() - t0
        rep = tiers.last_recovery
        tiers.wait()  # a lost host's own files written back (none here: the host is gone)
        tiers.close()
        fed = getattr(rep, "fed_bytes", 0)  # trees before recovery.feed have none
        out.update(tier=rep.tier, sources=dict(rep.bytes_by_source), fed=fed)
    else:
        unickpt.load(os.path.join(cfg["durable"], "step_00000001"), state)
        out["wall"] = time.perf_counter() - t0
        step = 1
    out["exact"] = step == 1 and all(
        torch.equal(p.to_local(), _expected(rank, ws, cfg["rows"], i)) for i, p in enumerate(module.parameters())
    )
    return out


def _reset(cfg: dict, lost: str) -> None:
    ram = os.path.join(cfg["base"], "ram")
    shutil.rmtree(ram, ignore_errors=True)
    subprocess.run(["cp", "-al", os.path.join(cfg["base"], "snap"), ram], check=True)
    shutil.rmtree(os.path.join(ram, lost), ignore_errors=True)


def _held_mib(folder: str) -> float:
    """The memory the files under ``folder`` hold: each inode once (hard links are not copies)."""
    seen: dict[tuple[int, int], int] = {}
    for top, _, files in os.walk(folder):
        for f in files:
            st = os.lstat(os.path.join(top, f))
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values()) / 2**20


def _ram_mib(cfg: dict, hosts: int, under: str = "ram") -> list[float]:
    return [_held_mib(os.path.join(cfg["base"], under, f"h{h}")) for h in range(hosts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB state")
    ap.add_argument("--gib", type=float, default=None)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="local disk folder for the durable copy (default /tmp)")
    args = ap.parse_args()
    gib = args.gib if args.gib is not None else (1 / 16 if args.quick else 1.0)
    hosts = args.hosts
    rows = max(hosts * (hosts - 1), int(gib * GiB) // (4 * COLS * N_TENSORS))
    rows -= rows % (hosts * (hosts - 1))  # divisible by both world sizes
    base = tempfile.mkdtemp(prefix="unickpt-reshard-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="unickpt-reshard-", dir=args.dir)
    cfg = {"base": base, "durable": disk, "rows": rows}
    t_start = time.monotonic()
    walls: dict[str, list[float]] = {"ram": [], "disk": []}
    first: dict[str, list[dict]] = {}
    try:
        progress(f"saving step 1 on {hosts} hosts ({rows * COLS * N_TENSORS * 4 / GiB:.3f} GiB)")
        spawn(save_main, hosts, cfg, timeout=1200, threads=1)
        subprocess.run(["cp", "-al", os.path.join(base, "ram"), os.path.join(base, "snap")], check=True)
        before = _ram_mib(cfg, hosts, "snap")
        after: list[float] = []
        for rnd in range(args.rounds):
            for arm in ("ram", "disk") if rnd % 2 == 0 else ("disk", "ram"):
                _reset(cfg, f"h{hosts - 1}")
                res = spawn(load_main, hosts - 1, cfg, arm, timeout=1200, threads=1)
                if isinstance(res, tuple):
                    res = res[0]
                if not all(r["exact"] for r in res):
                    raise SystemExit(f"{arm}: a load was not bit-exact: {res}")
                walls[arm].append(max(r["wall"] for r in res))
                first.setdefault(arm, res)
                if arm == "ram" and not after:
                    after = _ram_mib(cfg, hosts - 1)
                progress(f"round {rnd} {arm}: {walls[arm][-1]:.3f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    print(machine_line())
    print(f"state: {rows * COLS * N_TENSORS * 4 / GiB:.3f} GiB fp32 saved by {hosts} ranks on {hosts} hosts, "
          f"loaded by {hosts - 1} (host h{hosts - 1} lost); {args.rounds} rounds")  # fmt: skip
    rows_out = [[arm, f"{median(w):.3f}", f"{min(w):.3f}-{max(w):.3f}"] for arm, w in walls.items()]
    print(table("load wall, slowest rank (s)", ["arm", "median", "range"], rows_out))
    print(f"ram / disk = {median(walls['ram']) / median(walls['disk']):.2f}")
    src = first["ram"][0]
    print(f"ram recovery: tier {src['tier']}, bytes by source (MiB): "
          + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in src["sources"].items())
          + f"; read by the load straight from peers {src['fed'] / 2**20:.0f} MiB")  # fmt: skip
    print("RAM per host (MiB, hard links once) before -> after the recovery: "
          + ", ".join(f"h{h} {before[h]:.0f} -> {after[h]:.0f}" for h in range(hosts - 1)))  # fmt: skip
    print(f"\n(total {time.monotonic() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
