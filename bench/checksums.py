"""CRC32C throughput: unickpt's one implementation (``format.checksums.crc32c``, awscrt's
aws-checksums) against the ``crc32c`` package (what unickpt used before; the tests' oracle,
installed with the ``test`` and ``bench`` extras), on the same buffers in the same run.

    python bench/checksums.py
    python bench/checksums.py --mib 512 --repeat 9

Cases: 64 KiB pieces of one cache-resident buffer (the verifier folds each read of local files
into its CRC while the bytes are in the cache: ``engine.load.reader.FUSED``, 1 MiB; what that
saves: ``bench/fused_reads.py``), 4 MiB pieces of a ``--mib`` buffer (out of memory), and the
same split over 2 threads (both libraries release the GIL). GB = 1e9 bytes; best of
``--repeat`` runs; every checksum compared between the two.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_line, table

Crc = Callable[[memoryview, int], int]


def pieces(view: memoryview, piece: int, crc: Crc, threads: int) -> list[int]:
    """CRC32C of every ``piece`` of ``view``, the pieces dealt round-robin to ``threads`` threads."""
    starts = list(range(0, len(view), piece))
    out = [0] * len(starts)

    def work(k: int) -> None:
        for i in range(k, len(starts), threads):
            out[i] = crc(view[starts[i] : starts[i] + piece], 0)

    if threads == 1:
        work(0)
    else:
        ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return out


def _all(views: list[memoryview], piece: int, crc: Crc, threads: int) -> list[int]:
    return [x for v in views for x in pieces(v, piece, crc, threads)]


def best(fn: Callable[[], list[int]], repeat: int) -> tuple[float, list[int]]:
    took, got = float("inf"), []
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = fn()
        took = min(took, time.perf_counter() - t0)
    return took, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="the out-of-memory buffer")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import crc32c as package

    from unickpt.format.checksums import crc32c as ours

    print(machine_line())
    big = memoryview(bytearray(os.urandom(1 << 20)) * args.mib)
    small = big[: 64 << 10]
    cases = [
        ("64 KiB, cache-resident", lambda: [small] * 4096, 64 << 10, 1),
        (f"{args.mib} MiB in 4 MiB pieces", lambda: [big], 4 << 20, 1),
        (f"{args.mib} MiB in 4 MiB pieces, 2 threads", lambda: [big], 4 << 20, 2),
    ]
    rows = []
    for name, views, piece, threads in cases:
        results = {}
        for lib, crc in (("crc32c package", package.crc32c), ("unickpt", ours)):
            run = functools.partial(_all, views(), piece, crc, threads)
            took, got = best(run, args.repeat)
            results[lib] = (sum(len(v) for v in views()) / took / 1e9, got)
        same = results["unickpt"][1] == results["crc32c package"][1]
        a, b = results["crc32c package"][0], results["unickpt"][0]
        rows.append([name, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}", "yes" if same else "NO"])
    header = ["case", "crc32c package GB/s", "unickpt GB/s", "unickpt / package", "same CRCs"]
    print(table("CRC32C throughput (best of runs)", header, rows))


if __name__ == "__main__":
    main()
