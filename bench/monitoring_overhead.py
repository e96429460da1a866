"""Per-checkpoint cost of monitoring: the same blocking save without phase records
(``SaveOptions(record_phases=False)``), with them (the default: every rank's phase records kept
in the checkpoint, ``monitoring.phases``), and with them plus the JSON-lines sink and the summary
logger; interleaved (the order rotates every round), in one process.

    python bench/monitoring_overhead.py --mib 256 --repeats 9

Prints the median save time of each, the ratios to the save without records (target: under 1%)
and the size of the phase records file. Saves are written to a temporary folder (page cache;
fsync as usual). ``--small`` saves that many tiny tensors instead (the per-save fixed costs).
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
from unickpt.monitoring.phases import phases_name

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--layers", type=int, default=64, help="tensors (more tensors: more events)")
    ap.add_argument("--small", type=int, default=0, help="save this many 16-element tensors instead")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.small:
        model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16)) for _ in range(args.small)])
        what = f"{args.small} tensors of 16 floats"
    else:
        n = args.mib * MiB // 4 // args.layers
        model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for _ in range(args.layers)])
        what = f"{args.mib} MiB in {args.layers} tensors"
    tmp = tempfile.mkdtemp(prefix="unickpt-mon-")
    logging.getLogger("unickpt").setLevel(logging.INFO)
    logging.getLogger("unickpt").addHandler(logging.NullHandler())
    plain = unickpt.Checkpointer()
    sinks = unickpt.Checkpointer(listeners=[JsonlSink(os.path.join(tmp, "metrics")), SummaryLogger()])
    off = unickpt.SaveOptions(record_phases=False)
    on = unickpt.SaveOptions()
    variants = {"off": (plain, off), "recorded": (plain, on), "recorded+sinks": (sinks, on)}
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    record_bytes = 0
    try:
        for i in range(args.repeats + 1):
            order = names[i % len(names) :] + names[: i % len(names)]
            for label in order:
                ck, opts = variants[label]
                path = os.path.join(tmp, f"{label}-{i}")
                t0 = time.perf_counter()
                ck.save(path, {"model": model}, options=opts)
                dt = time.perf_counter() - t0
                if label == "recorded":
                    (save_id,) = os.listdir(os.path.join(path, "data"))
                    record_bytes = os.path.getsize(os.path.join(path, phases_name(save_id)))
                shutil.rmtree(path)
                if i > 0:  # the first round warms caches and the plan cache
                    times[label].append(dt)
    finally:
        plain.close()
        sinks.close()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{what}, {args.repeats} interleaved repeats (medians)")
    print(f"save without phase records: {med['off']:.4f} s")
    print(f"save with phase records (default): {med['recorded']:.4f} s, ratio {med['recorded'] / med['off']:.4f}")
    print(f"with records + JSON-lines sink + log line: {med['recorded+sinks']:.4f} s, "
          f"ratio {med['recorded+sinks'] / med['off']:.4f}")  # fmt: skip
    print(f"phase records file: {record_bytes} bytes (one rank)")


if __name__ == "__main__":
    main()
