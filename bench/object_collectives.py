"""unickpt's object collectives (``coordination.objects``, through ``TorchDistCoordinator``)
against torch's own (``dist.all_gather_object`` and the others) on the same gloo group, in the
same run, and what a load of almost nothing costs (the collectives a load makes, every rank).

    python bench/object_collectives.py                 # 2 and 4 ranks, 200 calls an arm
    python bench/object_collectives.py --ranks 2 4 8 --calls 400

Objects: a stage's outcome (``coordination.outcomes.Outcome`` with one claim, ~140 pickled
bytes) and a 20 KB one (over every slot: the two-round path). Arms run in rotating order;
each is the median over ``--rounds`` of the mean over ``--calls`` calls (rank 0's clock, after
a barrier). ``load 1 MiB``: ``unickpt.load`` of 1 MiB of DTensor shards per rank from a tmpfs,
the part of any load (a RAM recovery's included) that is not the bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import barrier, machine_line, median, progress, spawn, table

SMALL, LARGE = "small", "20 KB"


def rank_main(rank: int, ws: int, cfg: dict) -> dict | None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    import unickpt
    from unickpt.coordination.outcomes import Outcome
    from unickpt.coordination.torch_dist import CheckpointGroups, TorchDistCoordinator

    coord = TorchDistCoordinator(CheckpointGroups())
    group = coord.group
    objs = {SMALL: Outcome(claims=(("path", "/checkpoints/job/step_00000100"),)), LARGE: b"x" * 20_000}

    def torch_gather(o: object) -> None:
        out = [None] * ws if rank == 0 else None
        dist.gather_object(o, out, dst=0, group=group)

    def torch_scatter(o: object) -> None:
        out = [None]
        dist.scatter_object_list(out, [o] * ws if rank == 0 else None, src=0, group=group)

    def torch_broadcast(o: object) -> None:
        dist.broadcast_object_list([o], src=0, group=group)

    arms = {}
    for size, o in objs.items():
        arms[("all_gather", size, "torch")] = lambda o=o: dist.all_gather_object([None] * ws, o, group=group)
        arms[("all_gather", size, "unickpt")] = lambda o=o: coord.all_gather_object(o)
        arms[("broadcast", size, "torch")] = lambda o=o: torch_broadcast(o)
        arms[("broadcast", size, "unickpt")] = lambda o=o: coord.broadcast_object(o)
        arms[("gather", size, "torch")] = lambda o=o: torch_gather(o)
        arms[("gather", size, "unickpt")] = lambda o=o: coord.gather_object(o)
        arms[("scatter", size, "torch")] = lambda o=o: torch_scatter(o)
        arms[("scatter", size, "unickpt")] = lambda o=o: coord.scatter_object([o] * ws if rank == 0 else None)

    mesh = init_device_mesh("cpu", (ws,))
    m = nn.Module()
    for i in range(4):
        full = torch.randn(ws * 64, 1024)  # 1 MiB of fp32 a rank over the 4 tensors
        setattr(m, f"w{i}", nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]), requires_grad=False))
    unickpt.save(cfg["root"], {"model": m})
    arms[("load 1 MiB", "", "unickpt")] = lambda: unickpt.load(cfg["root"], {"model": m})

    names = list(arms)
    times: dict = {a: [] for a in names}
    for fn in arms.values():  # warm-up: connections, imports
        fn()
    for r in range(cfg["rounds"]):
        for a in names[r % len(names) :] + names[: r % len(names)]:
            calls = cfg["calls"] if a[0] != "load 1 MiB" else max(5, cfg["calls"] // 20)
            barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                arms[a]()
            times[a].append((time.perf_counter() - t0) / calls)
    barrier()
    return {"|".join(a): t for a, t in times.items()} if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(machine_line())
    rows = []
    for ws in args.ranks:
        progress(f"{ws} ranks")
        root = tempfile.mkdtemp(prefix="unickpt-objcoll-", dir="/dev/shm")
        try:
            times = spawn(rank_main, ws, {"root": os.path.join(root, "ckpt"), "calls": args.calls,
                                          "rounds": args.rounds}, threads=1)[0]  # fmt: skip
        finally:
            shutil.rmtree(root, ignore_errors=True)
        med = {tuple(a.split("|")): median(t) * 1e3 for a, t in times.items()}
        for (op, size, lib), ms in med.items():
            if lib == "torch":
                ours = med[(op, size, "unickpt")]
                rows.append([ws, op, size, f"{ms:.2f}", f"{ours:.2f}", f"{ours / ms:.2f}"])
            elif op == "load 1 MiB":
                rows.append([ws, op, "", "", f"{ms:.2f}", ""])
    header = ["ranks", "operation", "object", "torch ms", "unickpt ms", "unickpt / torch"]
    print(table("object collectives, mean ms a call (median of rounds)", header, rows, left=(1, 2)))
    print(f"\non {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
