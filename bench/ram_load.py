"""A load from host RAM (a tmpfs) against a raw read of the same bytes (issue 40, "Measured": a
load from RAM within 1.2x of a ``readinto`` of the same bytes), at a chosen number of ranks.

    python bench/ram_load.py                 # 1 rank, then 2 ranks; 512 MiB a rank; 5 rounds
    python bench/ram_load.py --ranks 4 --mib 256
    python bench/ram_load.py --ranks 2 --dir /var/tmp --cold    # from the disk, page cache dropped

Each rank holds ``--mib`` MiB of fp32 in 4 DTensors sharded by rows (1024 columns), saved once
with ``unickpt.save`` to a folder under /dev/shm (``--chunk-mib``: the checksum chunk). Then, in
rounds of rotating order, every rank (slowest rank's wall time):

  load     ``unickpt.load`` of the folder into the live DTensors (every chunk's CRC32C checked)
  nocrc    the same with ``LoadOptions(verify_checksums=False)``
  raw      ``preadv`` of this rank's data files into one pre-touched buffer (no unickpt)
  rawcrc   raw, then ``crc32c`` of the bytes per chunk (the least a verified read costs)

With ``--dir`` on a disk and ``--cold`` (root: ``drop_caches`` before every arm) the same arms
compare a cold load from the disk with a cold raw read of the same files, in the same processes.

Every load is checked bit for bit against the saved values. A rank's reads compete for the cores
with the other ranks': with fewer ranks than cores the load's verifier threads run beside its
readers (as on a GPU host, where ranks leave most cores idle); with one rank per core (or more)
every checksum is on the critical path.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import barrier, drop_page_cache, fmt_s, gather, machine_line, median, preadv_files, progress, spawn, table

MiB = 1 << 20
ARMS = ("load", "nocrc", "raw", "rawcrc")


def rank_main(rank: int, ws: int, cfg: dict) -> dict | None:
    import torch
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    import unickpt

    mesh = init_device_mesh("cpu", (ws,))
    rows = ws * cfg["mib"] * MiB // 4 // 4 // 1024  # 4 tensors of 1024 fp32 columns
    m = nn.Module()
    for i in range(4):
        full = torch.zeros(rows, 1024)
        setattr(m, f"w{i}", nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]), requires_grad=False))
    g = torch.Generator().manual_seed(rank)
    saved = []
    for p in m.parameters():
        p.to_local().copy_(torch.randn(p.to_local().shape, generator=g))
        saved.append(p.to_local().clone())
    root = cfg["root"]
    unickpt.save(root, {"model": m}, options=unickpt.SaveOptions(checksum_chunk_bytes=cfg["chunk"]))
    mine = sorted(
        os.path.join(top, f) for top, _, files in os.walk(root) for f in files if f.startswith(f"r{rank:05d}-")
    )
    sizes = [os.path.getsize(p) for p in mine]
    buf = torch.ones(sum(sizes), dtype=torch.uint8)  # touched: no page faults inside the clock
    view = memoryview(buf.numpy()).cast("B")

    def raw(check: bool) -> None:
        preadv_files(mine, sizes, view, cfg["chunk"] if check else 0)

    def load(verify: bool) -> None:  # the destinations were zeroed before the clock
        unickpt.load(root, {"model": m}, options=unickpt.LoadOptions(verify_checksums=verify))

    run = {"load": lambda: load(True), "nocrc": lambda: load(False), "raw": lambda: raw(False),
           "rawcrc": lambda: raw(True)}  # fmt: skip
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    exact = True
    for r in range(cfg["rounds"]):
        for arm in ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]:
            if arm in ("load", "nocrc"):
                for p in m.parameters():
                    p.to_local().zero_()
            if cfg["cold"]:
                barrier()
                if rank == 0:
                    drop_page_cache([root])
            barrier()
            t0 = time.perf_counter()
            run[arm]()
            took = time.perf_counter() - t0
            times[arm].append(max(gather(took)))
            if arm in ("load", "nocrc"):
                exact = exact and all(torch.equal(a, p.to_local()) for a, p in zip(saved, m.parameters()))
    ok = all(gather(exact))
    barrier()
    return {"times": times, "exact": ok, "bytes": sum(sizes)} if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--mib", type=int, default=512, help="MiB of state a rank holds")
    ap.add_argument("--chunk-mib", type=int, default=16, help="checksum chunk (the RAM tier's default)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm", help="where the checkpoint is saved (a tmpfs: RAM)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every arm (a disk --dir)")
    args = ap.parse_args()
    print(machine_line())
    rows = []
    for ws in args.ranks:
        root = tempfile.mkdtemp(prefix="unickpt-ramload-", dir=args.dir)
        try:
            progress(f"{ws} rank(s), {args.mib} MiB a rank")
            cfg = {"root": os.path.join(root, "ckpt"), "mib": args.mib, "chunk": args.chunk_mib * MiB,
                   "rounds": args.rounds, "cold": args.cold}  # fmt: skip
            res = spawn(rank_main, ws, cfg, threads=1)[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        med = {a: median(res["times"][a]) for a in ARMS}
        rows.append([ws, *(fmt_s(med[a]) for a in ARMS), f"{med['load'] / med['raw']:.2f}",
                     f"{med['load'] / med['rawcrc']:.2f}", f"{med['nocrc'] / med['raw']:.2f}",
                     "yes" if res["exact"] else "NO"])  # fmt: skip
    header = ["ranks", "load s", "nocrc s", "raw s", "rawcrc s", "load/raw", "load/rawcrc", "nocrc/raw", "exact"]
    where = "a tmpfs" if args.dir.startswith("/dev/shm") else args.dir + (", cold" if args.cold else "")
    print(table(f"load from {where} vs raw preadv ({args.mib} MiB a rank; medians of {args.rounds})", header, rows))
    print(f"\non {os.cpu_count()} cores; goal: load/raw <= 1.2")


if __name__ == "__main__":
    main()
