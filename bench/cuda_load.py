"""Cold load onto one GPU: unickpt vs PyTorch DCP vs the raw bytes, from a disk folder and /dev/shm.

A stack of Linear layers with Adam state (``--gib`` in total) is saved once per folder by unickpt
and by DCP. Each round, for each folder, each load (order rotated per round) starts with the page
cache dropped (``sync; echo 3 > /proc/sys/vm/drop_caches`` as root, else the files evicted with
``posix_fadvise``; ``--no-drop``: warm) and ends with ``torch.cuda.synchronize()``:

- unickpt: ``unickpt.load`` into the live GPU model and optimizer with
  ``ReadOptions.pinned_device_copies`` (pinned bounce buffers, the host-to-device copies on a side
  stream, ``engine.load.device``);
- unickpt-blocking: the same without that option (the default: each piece read into host memory,
  then a blocking copy to the device);
- DCP: ``dcp.load`` + ``set_state_dict`` into the same kind of GPU model;
- raw: the unickpt checkpoint's files themselves, one thread per file, ``readinto`` two pinned
  16 MiB buffers in turn and a ``non_blocking`` copy of each into one device buffer (a stream
  and two events per thread): what the disk and the bus give without any format.

Every load is checked bit-exact (the model and optimizer state against copies taken at the
save, on the device; the raw buffer against the files' bytes). Medians over ``--rounds``
(after one warm-up load per tool), GB/s (GB = 1e9 bytes), and ratios: raw / unickpt (>= 0.9
is the goal) and DCP / unickpt (> 1: unickpt faster).

Run on the GPU machine from the repo root:
  PYTHONPATH=$PWD/src:$PWD python3 bench/cuda_load.py --gib 2 --rounds 3 --dirs /tmp,/dev/shm
Here (no GPU): ``--device cpu --gib 0.1 --no-drop`` runs the same code as a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import unickpt
from _common import (
    EventLog,
    dcp_state_dict,
    device_model,
    drop_page_cache,
    files_under,
    model_shape,
    phase_breakdown,
    state_tensors,
    sync_device,
    table,
    train_step,
)
from unickpt.options import ReadOptions

CHUNK = 16 << 20  # the raw baseline's read size (unickpt reads 16 MiB pieces too)
TOOLS = ("unickpt", "unickpt-blocking", "dcp", "raw")


class RawReader:
    """The raw baseline: ``files`` read whole into one device buffer (offsets in file order)."""

    def __init__(self, files: list[str], device: str) -> None:
        self.files, self.device = files, device
        self.sizes = [os.path.getsize(f) for f in files]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(files))]
        total = sum(self.sizes)
        self.out = torch.empty(total, dtype=torch.uint8, device=device)
        pin = device == "cuda"
        self.buffers = [[torch.empty(CHUNK, dtype=torch.uint8, pin_memory=pin) for _ in range(2)] for _ in files]
        self.streams = [torch.cuda.Stream() for _ in files] if pin else [None] * len(files)
        self.events = [[torch.cuda.Event() for _ in range(2)] for _ in files] if pin else None
        want = torch.empty(total, dtype=torch.uint8)  # the files' bytes (read warm, once)
        for f, off, n in zip(files, self.offsets, self.sizes):
            with open(f, "rb") as fh:
                fh.readinto(memoryview(want[off : off + n].numpy()))
        self.want = want.to(device)

    def _one(self, i: int) -> None:
        size, base = self.sizes[i], self.offsets[i]
        bufs, stream = self.buffers[i], self.streams[i]
        pos = k = 0
        with open(self.files[i], "rb", buffering=0) as fh:
            while pos < size:
                b = bufs[k % 2]
                if self.events is not None and k >= 2:
                    self.events[i][k % 2].synchronize()  # that buffer's previous copy is done
                n = fh.readinto(memoryview(b.numpy())[: min(CHUNK, size - pos)])
                if not n:
                    raise OSError(f"{self.files[i]}: short read at {pos}")
                if stream is not None:
                    with torch.cuda.stream(stream):
                        self.out[base + pos : base + pos + n].copy_(b[:n], non_blocking=True)
                        self.events[i][k % 2].record(stream)
                else:
                    self.out[base + pos : base + pos + n].copy_(b[:n])
                pos += n
                k += 1
        if stream is not None:
            stream.synchronize()

    def load(self) -> None:
        self.out.zero_()
        sync_device(self.device)
        threads = [threading.Thread(target=self._one, args=(i,)) for i in range(len(self.files))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.elapsed = time.perf_counter() - t0

    def exact(self) -> bool:
        return bool(torch.equal(self.out, self.want))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="params + Adam state, GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dirs", default="/tmp,/dev/shm", help="comma-separated parents of the checkpoints")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-drop", action="store_true", help="do not drop the page cache before a load (warm)")
    ap.add_argument("--threads", type=int, default=None, help="unickpt LoadOptions.io.threads (default: its own)")
    args = ap.parse_args()
    device = args.device
    t_start = time.perf_counter()
    layers, dim = model_shape(args.gib)
    model, optim = device_model(layers, dim, device, seed=0)
    x = torch.randn(64, dim, device=device)
    train_step(model, optim, x)
    want = [t.clone() for t in state_tensors(model, optim)]  # the expected values, on the device
    nbytes = sum(t.numel() * t.element_size() for t in want)
    target, topt = device_model(layers, dim, device, seed=1)
    train_step(target, topt, x)
    io = ReadOptions() if args.threads is None else ReadOptions(threads=args.threads)
    opts = {
        "unickpt": unickpt.LoadOptions(io=dataclasses.replace(io, pinned_device_copies=True)),
        "unickpt-blocking": unickpt.LoadOptions(io=dataclasses.replace(io, pinned_device_copies=False)),
    }
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"device {name}; torch {torch.__version__}; {os.cpu_count()} CPUs")
    print(f"state {nbytes / 2**30:.2f} GiB ({layers} x Linear({dim}, {dim}) + Adam)")
    roots = []
    setups: dict[str, dict[str, Any]] = {}
    try:
        for parent in args.dirs.split(","):
            root = tempfile.mkdtemp(prefix="cuda_load_", dir=parent)
            roots.append(root)
            ours, theirs = os.path.join(root, "unickpt"), os.path.join(root, "dcp")
            unickpt.save(ours, {"model": model, "optimizer": optim}).wait()
            import torch.distributed.checkpoint as dcp

            dcp.save(dcp_state_dict(model, optim), checkpoint_id=theirs)
            raw = RawReader(sorted(files_under([ours])), device)
            setups[parent] = {"unickpt": ours, "dcp": theirs, "raw": raw}
        del model, optim
        print(f"setup (saves, expected values) {time.perf_counter() - t_start:.1f} s; folders {', '.join(roots)}")

        log = EventLog()
        phases: dict[str, list[dict[str, float]]] = {}

        def one(tool: str, parent: str) -> float:
            s = setups[parent]
            log.take()
            if tool == "raw":
                s["raw"].load()
                if not s["raw"].exact():
                    raise SystemExit(f"raw read from {parent}: bytes differ from the files")
                return float(s["raw"].elapsed)
            with torch.no_grad():
                for t in state_tensors(target, topt):
                    t.zero_()
            sync_device(device)
            t0 = time.perf_counter()
            if tool in opts:
                unickpt.load(s["unickpt"], {"model": target, "optimizer": topt}, options=opts[tool])
            else:
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict import set_state_dict

                sd = dcp_state_dict(target, topt)
                dcp.load(sd, checkpoint_id=s["dcp"])
                set_state_dict(target, topt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            sync_device(device)
            dt = time.perf_counter() - t0
            got = state_tensors(target, topt)
            if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want)):
                raise SystemExit(f"{tool} load from {parent}: state differs from the saved state")
            if tool == "unickpt":
                phases.setdefault(parent, []).append(_phases(log.take()))
            return dt

        for tool in TOOLS:  # warm-up: CUDA context, pinned memory, imports, plans
            one(tool, args.dirs.split(",")[-1])
        phases.clear()
        res: dict[tuple[str, str], list[float]] = {}
        how = "warm (--no-drop)"
        for r in range(args.rounds):
            order = TOOLS[r % len(TOOLS) :] + TOOLS[: r % len(TOOLS)]
            for parent in setups:
                for tool in order:
                    if not args.no_drop:
                        how = drop_page_cache([setups[parent]["unickpt"], setups[parent]["dcp"]])
                    res.setdefault((parent, tool), []).append(one(tool, parent))
        rows = []
        for parent in setups:
            med = {tool: statistics.median(res[(parent, tool)]) for tool in TOOLS}
            for tool in TOOLS:
                rows.append(
                    [
                        parent,
                        tool,
                        f"{med[tool]:.3f}",
                        f"{nbytes / med[tool] / 1e9:.2f}",
                        f"{med['raw'] / med[tool]:.2f}x",
                        f"{med['dcp'] / med[tool]:.2f}x",
                    ]
                )
        print(f"page cache before each load: {how}; {args.rounds} rounds, order rotated; every load bit-exact")
        print(
            table(
                "median s of a load onto the GPU (raw/tool >= 0.9: the goal; dcp/tool > 1: faster than DCP)",
                ["folder", "tool", "s", "GB/s", "raw/tool", "dcp/tool"],
                rows,
                left=(0, 1),
            )
        )
        for parent, ps in phases.items():
            keys = sorted({k for p in ps for k in p})
            print(
                f"  unickpt phases from {parent} (medians, s): "
                + "  ".join(f"{k}={statistics.median(p.get(k, float('nan')) for p in ps):.3f}" for k in keys)
            )
        for key, xs in sorted(res.items()):
            print(f"  {key[0]} {key[1]}: " + " ".join(f"{x:.3f}" for x in xs))
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
    print(f"total {time.perf_counter() - t_start:.1f} s")


def _phases(events: list[Any]) -> dict[str, float]:
    """One unickpt load's phases (``phase_breakdown``) and, inside its read, the thread-seconds in
    read calls (io), checksums (crc) and copies into place (copy: host-to-device issued here)."""
    out = phase_breakdown(events)
    for ev in events:
        name = {"load.read.io": "io", "load.checksum": "crc", "load.copy": "copy"}.get(ev.phase)
        if name is not None and ev.detail:
            out[name] = float(str(ev.detail).split()[0])
    return out


if __name__ == "__main__":
    main()
