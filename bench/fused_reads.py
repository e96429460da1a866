"""What checking every byte costs a read from host RAM, by how the reads are cut (the load engine's
``engine.load.reader.FUSED``): the CPU a verified read of a tmpfs file takes against a raw one.

    python bench/fused_reads.py                       # 2 and 4 processes, 512 / 256 MiB each
    python bench/fused_reads.py --procs 4 --mib 256 --rounds 15

``--procs`` processes at once (the ranks of one host; with as many or more than the cores, as on
this 2-core machine, every checksum is on the critical path), each with a file of ``--mib`` MiB
of random bytes under /dev/shm and a pre-touched torch buffer (allocated as a load's destination
tensors are). Arms, in rotating order, every process starting each arm together (a barrier):

  raw        ``preadv`` of the file in 16 MiB reads (no check)
  then-crc   raw, then ``crc32c`` of the buffer in 16 MiB pieces (bytes read back from memory)
  fused-N    reads of N KiB, each folded into the running CRC32C right after it lands (while
             its bytes are in the core's cache), as the load does for local files

Printed per arm: CPU seconds of one process (median over processes and rounds; the thread's own
CPU, so what other processes of the machine do counts less than in wall time) and the slowest
process's wall time (median over rounds), each against raw. Every CRC is compared with the
whole file's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_line, table

MiB = 1 << 20
READ = 16 * MiB
FUSED_KIB = (4096, 1024, 256)


def _process(rank: int, size: int, rounds: int, arms: list[str], barrier, out) -> None:
    import torch

    from unickpt.format.checksums import crc32c

    torch.set_num_threads(1)
    path = f"/dev/shm/unickpt-fused-{os.getpid()}"
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(size))
        buf = torch.ones(size, dtype=torch.uint8)  # touched: no page faults inside the clock
        view = memoryview(buf.numpy()).cast("B")
        fd = os.open(path, os.O_RDONLY)
        os.preadv(fd, [view], 0)
        whole = crc32c(view)

        def run(arm: str) -> int:
            crc = 0
            if arm in ("raw", "then-crc"):
                for lo in range(0, size, READ):
                    os.preadv(fd, [view[lo : lo + READ]], lo)
                if arm == "then-crc":
                    for lo in range(0, size, READ):
                        crc = crc32c(view[lo : lo + READ], crc)
                return crc
            step = int(arm.split("-")[1]) << 10
            for lo in range(0, size, step):
                piece = view[lo : lo + step]
                os.preadv(fd, [piece], lo)
                crc = crc32c(piece, crc)
            return crc

        cpu: dict[str, list[float]] = {a: [] for a in arms}
        wall: dict[str, list[float]] = {a: [] for a in arms}
        for r in range(rounds):
            for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                barrier.wait()
                c0, t0 = time.thread_time(), time.perf_counter()
                crc = run(arm)
                wall[arm].append(time.perf_counter() - t0)
                cpu[arm].append(time.thread_time() - c0)
                if arm != "raw" and crc != whole:
                    raise AssertionError(f"{arm}: CRC {crc:#x}, the file's is {whole:#x}")
        os.close(fd)
        out.put((rank, cpu, wall))
    finally:
        os.unlink(path)


def run_case(procs: int, mib: int, rounds: int) -> list[list[str]]:
    arms = ["raw", "then-crc", *(f"fused-{k}" for k in FUSED_KIB)]
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_process, args=(r, mib * MiB, rounds, arms, barrier, out)) for r in range(procs)]
    for p in ps:
        p.start()
    got = [out.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    cpu = {a: statistics.median([x for _, c, _ in got for x in c[a]]) for a in arms}
    wall = {a: statistics.median([max(w[a][i] for _, _, w in got) for i in range(rounds)]) for a in arms}
    rows = []
    for a in arms:
        ratios = f"{cpu[a] / cpu['raw']:.2f}", f"{wall[a]:.4f}", f"{wall[a] / wall['raw']:.2f}"
        rows.append([f"{procs} x {mib} MiB", a, f"{cpu[a]:.4f}", *ratios])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mib", type=int, default=0, help="MiB per process (default: 1 GiB over the processes)")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    print(machine_line())
    rows = []
    for n in args.procs:
        rows += run_case(n, args.mib or 1024 // n, args.rounds)
    header = ["processes", "arm", "CPU s", "CPU / raw", "wall s", "wall / raw"]
    print(table("verified reads from a tmpfs: CPU of one process, slowest process's wall", header, rows, left=(0, 1)))


if __name__ == "__main__":
    main()
