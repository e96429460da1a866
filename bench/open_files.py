"""Cold reads of data files by how often each file is opened: what holding a file open for a
whole stream of 1 MiB reads does against opening it per read (the load engine's local reads)
or per 16 MiB piece. Needs root (``drop_caches``).

    python bench/open_files.py --dir /var/tmp --rounds 6

``--procs`` processes at once (the ranks of one host), each with ``--files`` files of ``--mib``
MiB of random bytes under ``--dir``, read by one thread a file into a pre-touched torch buffer
(as a load's destinations are) in reads of 1 MiB, each folded into the file's CRC32C right after
it lands (``engine.load.reader.FUSED``). Before every arm the page cache is dropped; arms rotate
each round, all processes start each arm together. Arms:

  per-read   ``os.open`` of the file for every 1 MiB read, closed after it (what
             ``LocalStorage.read_into`` does per call, less its folder walk)
  per-piece  one open per 16 MiB piece, 1 MiB reads inside it
  per-file   one open for the whole file

Printed per arm: the slowest process's wall time in every round (in run order), their median,
and how many 2 MiB page-cache folios the arm's reads made the kernel build (``/proc/vmstat``
``nr_file_hugepages`` after the reads, before the next drop). A file read front to back on one
open file lets the kernel's read-ahead grow, and with it the folios it allocates for the page
cache, up to 2 MiB. Where the machine is a VM that reports free memory to its host
(virtio-balloon free page reporting, ``/sys/module/page_reporting``), a 2 MiB block that was
reported must be faulted back in by the host on first touch: rounds of the per-file arm that
draw such blocks are several times slower (docs/performance.md, "Read tuning tried").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_line, table

MiB = 1 << 20
READ = MiB
PIECE = 16 * MiB
ARMS = ("per-read", "per-piece", "per-file")


def _read(path: str, view: memoryview, arm: str) -> int:
    from unickpt.format.checksums import crc32c

    n, off, crc = os.path.getsize(path), 0, 0
    fd = os.open(path, os.O_RDONLY) if arm == "per-file" else -1
    try:
        while off < n:
            if arm == "per-piece" and off % PIECE == 0:
                if fd >= 0:
                    os.close(fd)
                fd = os.open(path, os.O_RDONLY)
            one = os.open(path, os.O_RDONLY) if arm == "per-read" else fd
            try:
                part = view[off : min(n, off + READ)]
                got = os.preadv(one, [part], off)
                if got <= 0:
                    raise EOFError(path)
                crc = crc32c(part[:got], crc)
                off += got
            finally:
                if arm == "per-read":
                    os.close(one)
    finally:
        if fd >= 0:
            os.close(fd)
    return crc


def _huge() -> int:
    with open("/proc/vmstat") as f:
        return next((int(v) for k, v in (line.split() for line in f) if k == "nr_file_hugepages"), 0)


def _process(rank: int, paths: list[str], rounds: int, barrier, out) -> None:
    import torch

    size = sum(os.path.getsize(p) for p in paths)
    buf = torch.ones(size, dtype=torch.uint8)  # touched: no page faults inside the clock
    view = memoryview(buf.numpy()).cast("B")
    views, at = [], 0
    for p in paths:
        views.append(view[at : at + os.path.getsize(p)])
        at += os.path.getsize(p)
    for r in range(rounds):
        for arm in ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]:
            barrier.wait()
            if rank == 0:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            barrier.wait()
            t0 = time.perf_counter()
            threads = [threading.Thread(target=_read, args=(p, v, arm)) for p, v in zip(paths, views)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            took = time.perf_counter() - t0
            barrier.wait()
            out.put((rank, r, arm, took, _huge() if rank == 0 else 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp", help="a folder on the disk (not a tmpfs)")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--files", type=int, default=2, help="files a process reads side by side")
    ap.add_argument("--mib", type=int, default=256, help="MiB a file")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    print(machine_line())
    folder = os.path.join(args.dir, f"unickpt-openfiles-{os.getpid()}")
    os.makedirs(folder)
    try:
        paths = [[os.path.join(folder, f"p{p}-f{f}.bin") for f in range(args.files)] for p in range(args.procs)]
        for path in (x for row in paths for x in row):
            with open(path, "wb") as f:
                for _ in range(args.mib):
                    f.write(os.urandom(MiB))
        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(args.procs), ctx.Queue()
        procs = [ctx.Process(target=_process, args=(r, paths[r], args.rounds, barrier, out)) for r in range(args.procs)]
        for p in procs:
            p.start()
        got = [out.get(timeout=600) for _ in range(args.procs * args.rounds * len(ARMS))]
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = []
    for arm in ARMS:
        walls = [max(t for _, rr, a, t, _ in got if a == arm and rr == r) for r in range(args.rounds)]
        folios = [h for rank, _, a, _, h in got if a == arm and rank == 0]
        rows.append([arm, " ".join(f"{w:.3f}" for w in walls), f"{statistics.median(walls):.3f}", max(folios)])
    header = ["opened", "slowest process per round, s", "median s", "2 MiB folios after (most)"]
    title = f"cold reads, {args.procs} processes x {args.files} files x {args.mib} MiB, 1 MiB reads + CRC32C"
    print(table(title, header, rows))


if __name__ == "__main__":
    main()
