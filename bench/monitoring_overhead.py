"""Per-checkpoint cost of monitoring: the same blocking save with no listener, and with the
JSON-lines sink + the summary logger, interleaved, in one process.

    python bench/monitoring_overhead.py --mib 256 --repeats 7

Prints the median save time of each and the overhead ratio (target: under 1%). Saves are
written to a temporary folder (page cache; fsync as usual).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time

import torch

import unickpt
from unickpt.monitoring import JsonlSink, SummaryLogger

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=64, help="tensors (more tensors: more events)")
    args = ap.parse_args()
    n = args.mib * MiB // 4 // args.layers
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for _ in range(args.layers)])
    tmp = tempfile.mkdtemp(prefix="unickpt-mon-")
    logging.getLogger("unickpt").setLevel(logging.INFO)
    logging.getLogger("unickpt").addHandler(logging.NullHandler())
    off = unickpt.Checkpointer()
    on = unickpt.Checkpointer(listeners=[JsonlSink(os.path.join(tmp, "metrics")), SummaryLogger()])
    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for i in range(args.repeats + 1):
            for label, ck in (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off)):
                path = os.path.join(tmp, f"{label}-{i}")
                t0 = time.perf_counter()
                ck.save(path, {"model": model})
                dt = time.perf_counter() - t0
                shutil.rmtree(path)
                if i > 0:  # the first round warms caches and the plan cache
                    times[label].append(dt)
    finally:
        off.close()
        on.close()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.mib} MiB in {args.layers} tensors, {args.repeats} interleaved repeats")
    print(f"save without listeners: median {med['off']:.4f} s; with JSON-lines sink + log line: {med['on']:.4f} s")
    print(f"monitoring overhead per checkpoint: {100 * (med['on'] / med['off'] - 1):+.2f}% (target < 1%)")


if __name__ == "__main__":
    main()
