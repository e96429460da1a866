"""Shared helpers for the unickpt benchmarks (bench/save_load.py, bench/async_stall.py, bench/three_way.py).

- ``spawn(fn, world_size, *args)``: run ``fn(rank, world_size, *args)`` on N gloo ranks (or in one
  process without a process group when ``world_size == 0``), return every rank's result.
- ``evict(paths)``: drop every file under ``paths`` from the page cache (fdatasync, then
  ``posix_fadvise(DONTNEED)``), so that the next read comes from the disk ("cold");
  ``drop_page_cache(paths)``: the whole page cache (``sync; echo 3 > drop_caches``, as root), then
  ``evict(paths)`` as well (the fallback where ``drop_caches`` is not writable).
- ``free_port()``: a free local TCP port (for launchers that start ranks with subprocess).
- ``timed(fn)``: barrier, run, barrier: the wall time of a collective operation on this rank.
- raw disk baselines: buffered write+fsync, O_DIRECT write, cold read, all from/into buffers
  allocated and touched once (never fresh memory inside a timed region).
- ``PeakRSS``: a sampling thread giving the peak resident set size inside labelled regions.
- ``Model``: a stack of ``nn.Linear(d, d, bias=False)`` sized from a GiB target (params + Adam).
- table printing and small statistics.

Numbers are GB = 1e9 bytes per second; sizes are printed in GiB.
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

GiB = 1 << 30
GB = 1e9
CHUNK = 16 << 20  # raw-disk baselines move 16 MiB per system call
ALIGN = 4096


# --------------------------------------------------------------------------------------------
# processes


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 900, threads: int | None = None
) -> list[Any]:
    """``unickpt.testing.launch.run_ranks``: ``fn(rank, world_size, *args)`` on fresh gloo ranks
    (``world_size=0``: one process without a process group)."""
    from unickpt.testing.launch import run_ranks  # here: bench/three_way.py's ranks may run another unickpt

    return run_ranks(fn, world_size, *args, timeout=timeout, threads=threads)


# --------------------------------------------------------------------------------------------
# timing and collectives


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of ``fn`` as a collective: barrier, run, barrier (all ranks see ~the same)."""
    barrier()
    t0 = time.perf_counter()
    out = fn()
    barrier()
    return time.perf_counter() - t0, out


def gather(obj: Any) -> list[Any]:
    """all_gather_object (or ``[obj]`` without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------------------------
# page cache


def files_under(paths: Iterable[str]) -> list[str]:
    out = []
    for root in paths:
        if os.path.isfile(root):
            out.append(root)
            continue
        for d, _dirs, files in os.walk(root):
            out.extend(os.path.join(d, f) for f in files)
    return out


def evict(paths: Iterable[str]) -> int:
    """Drop every file under ``paths`` from the page cache; returns the number of files.

    fdatasync first (a no-op for files already durable), so that no page is dirty and
    POSIX_FADV_DONTNEED can drop all of them."""
    n = 0
    for f in files_under(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def drop_page_cache(paths: Iterable[str]) -> str:
    """Make the next read of ``paths`` cold: ``sync`` and ``echo 3 > /proc/sys/vm/drop_caches``
    (the whole page cache; needs root), then ``evict(paths)`` in any case. Returns the method that
    dropped the whole cache (``"drop_caches"``) or ``"fadvise"`` where only the files were evicted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        how = "drop_caches"
    except OSError:
        how = "fadvise"
    evict(paths)
    return how


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_under([path]))


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def make_tmp(base: str | None, need_bytes: int) -> str:
    """A fresh folder under ``base`` (default /tmp), refusing if the disk lacks ``need_bytes``."""
    base = base or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    free = shutil.disk_usage(base).free
    if free < need_bytes * 1.2 + 2 * GiB:
        raise SystemExit(f"{base}: {free / GiB:.1f} GiB free, this run needs ~{need_bytes / GiB:.1f} GiB")
    return tempfile.mkdtemp(prefix="unickpt-bench-", dir=base)


# --------------------------------------------------------------------------------------------
# raw disk baselines (buffers allocated and touched once, outside the timed regions)


class RawBuffer:
    """A page-aligned, pre-faulted 16 MiB buffer of random bytes (no zero-page tricks)."""

    def __init__(self, size: int = CHUNK, seed: int = 0) -> None:
        self.mm = mmap.mmap(-1, size)
        self.view = memoryview(self.mm)
        arr = np.frombuffer(self.view, dtype=np.uint8)
        arr[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)

    def close(self) -> None:
        self.view.release()
        self.mm.close()


def raw_write_buffered(path: str, nbytes: int, buf: RawBuffer) -> None:
    """write(2) ``nbytes`` in 16 MiB calls through the page cache, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            n = min(len(buf.view), nbytes - done)
            done += os.write(fd, buf.view[:n])
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_direct_one(path: str, nbytes: int, buf: RawBuffer) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        padded = -(-nbytes // ALIGN) * ALIGN
        done = 0
        while done < padded:
            n = min(len(buf.view), padded - done)
            done += os.pwrite(fd, buf.view[:n], done)
        os.ftruncate(fd, nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def split(nbytes: int, parts: int) -> list[int]:
    base = nbytes // parts // ALIGN * ALIGN
    out = [base] * parts
    out[-1] = nbytes - base * (parts - 1)
    return out


def raw_write_direct(paths: Sequence[str], nbytes: int, bufs: Sequence[RawBuffer]) -> None:
    """O_DIRECT: ``nbytes`` split over ``paths``, one thread per file (queue depth = files),
    aligned 16 MiB pwrite calls from pre-touched buffers, then fsync."""
    sizes = split(nbytes, len(paths))
    threads = [threading.Thread(target=_write_direct_one, args=(p, s, b)) for p, s, b in zip(paths, sizes, bufs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _read_one(path: str, buf: RawBuffer, out: list[int], i: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while True:
            n = os.preadv(fd, [buf.view], done)
            if n == 0:
                break
            done += n
        out[i] = done
    finally:
        os.close(fd)


def preadv_files(paths: Sequence[str], sizes: Sequence[int], view: memoryview, crc_every: int = 0) -> int:
    """``preadv`` of whole files one after another into ``view`` (their bytes back to back; a
    pre-touched buffer, so no page fault is timed); ``crc_every``: then ``crc32c`` of each file's
    bytes in pieces of that many bytes, with the implementation the load uses (the least a
    verified read costs; the ``crc32c`` package under a ``--baseline-src`` tree from before
    ``format.checksums.crc32c``). Returns the bytes read."""
    try:
        from unickpt.format.checksums import crc32c
    except ImportError:
        from crc32c import crc32c

    at = 0
    for path, size in zip(paths, sizes):
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < size:
                done += os.preadv(fd, [view[at + done : at + size]], done)
        finally:
            os.close(fd)
        if crc_every:
            for lo in range(at, at + size, crc_every):
                crc32c(view[lo : min(at + size, lo + crc_every)])
        at += size
    return at


def raw_read(paths: Sequence[str], bufs: Sequence[RawBuffer]) -> int:
    """Buffered preadv of whole files in 16 MiB calls into pre-touched buffers, one thread per
    file; returns the bytes read."""
    got = [0] * len(paths)
    threads = [threading.Thread(target=_read_one, args=(p, b, got, i)) for i, (p, b) in enumerate(zip(paths, bufs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(got)


def raw_read_direct(paths: Sequence[str], bufs: Sequence[RawBuffer]) -> int:
    """O_DIRECT ``preadv`` of whole files in 16 MiB chunks by ``len(bufs)`` threads (each with
    its own pre-touched buffer), every chunk of every file in flight on some thread: the
    deep-queue read the device is best at; returns the bytes read."""
    jobs = [(p, off) for p in paths for off in range(0, os.path.getsize(p), CHUNK)]
    lock = threading.Lock()
    got = [0]

    def worker(buf: RawBuffer) -> None:
        fds: dict[str, int] = {}
        try:
            while True:
                with lock:
                    if not jobs:
                        return
                    path, off = jobs.pop()
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
                n = os.preadv(fds[path], [buf.view], off)
                with lock:
                    got[0] += n
        finally:
            for fd in fds.values():
                os.close(fd)

    threads = [threading.Thread(target=worker, args=(b,)) for b in bufs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got[0]


# --------------------------------------------------------------------------------------------
# memory


def dcp_state_dict(model: Any, optim: Any) -> dict[str, Any]:
    """What the DCP baselines save and load: ``get_state_dict`` of the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def dcp_save(model: Any, optim: Any, path: str) -> None:
    """PyTorch DCP's save of a model and optimizer: ``get_state_dict`` + ``dcp.save``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(dcp_state_dict(model, optim), checkpoint_id=path)


def dcp_load(model: Any, optim: Any, path: str) -> None:
    """PyTorch DCP's load: ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = dcp_state_dict(model, optim)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class PeakRSS:
    """Samples this process's RSS every ``interval`` s; ``region(label)`` appends, per label,
    ``(rss before, peak rss inside, rss after)`` for every occurrence."""

    def __init__(self, interval: float = 0.005) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.regions: dict[str, list[tuple[int, int, int]]] = {}
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            r = self._proc.memory_info().rss
            with self._lock:
                self._peak = max(self._peak, r)

    @contextmanager
    def region(self, label: str) -> Iterator[None]:
        before = self._proc.memory_info().rss
        with self._lock:
            self._peak = before
        try:
            yield
        finally:
            r = self._proc.memory_info().rss
            with self._lock:
                peak = max(self._peak, r)
            self.regions.setdefault(label, []).append((before, peak, r))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------------------------
# model


def model_shape(gib: float) -> tuple[int, int]:
    """(layers, dim) of a stack of Linear(dim, dim) whose fp32 params + Adam exp_avg and
    exp_avg_sq (12 bytes per parameter) take about ``gib`` GiB; dim 4096 unless that gives
    fewer than 2 layers, then a smaller dim (multiple of 64)."""
    per_layer = 12 * 4096 * 4096
    layers = round(gib * GiB / per_layer)
    if layers >= 2:
        return layers, 4096
    dim = int((gib * GiB / (12 * 2)) ** 0.5) // 64 * 64
    return 2, max(64, dim)


def build_model(
    layers: int, dim: int, seed: int, fsdp2: bool, lr: float = 1e-4, reshard_after_forward: bool = True
) -> tuple[Any, Any]:
    """The stack (FSDP2: every layer and the root ``fully_shard``-ed) and its Adam optimizer.

    ``reshard_after_forward=False`` (ZeRO-2 style) saves the second all-gather in backward:
    the parameters are sharded again after backward either way, so checkpoints see the same
    sharded DTensors."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    if fsdp2:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    return model, optim


def device_model(layers: int, dim: int, device: str, seed: int = 0) -> tuple[Any, Any]:
    """``build_model``'s stack (no FSDP) on ``device`` with an Adam over its parameters there."""
    import torch

    model, _ = build_model(layers, dim, seed=seed, fsdp2=False)
    model.to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def sync_device(device: str) -> None:
    """Wait for the GPU's queued work (timers around GPU work); nothing on the CPU."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def state_tensors(model: Any, optim: Any) -> list[Any]:
    """The model's parameters and the optimizer's state tensors, in a fixed order (bit-exact checks)."""
    import torch

    out = [p.detach() for p in model.parameters()]
    for st in optim.state.values():
        out += [v for v in st.values() if torch.is_tensor(v)]
    return out


def train_step(model: Any, optim: Any, x: Any) -> None:
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def local_tensors(model: Any, optim: Any) -> dict[str, Any]:
    """Every parameter / optimizer-state tensor this rank holds (DTensor -> its local shard)."""
    out = {}
    names = {}
    for n, p in model.named_parameters():
        out["model." + n] = _local(p)
        names[id(p)] = n
    for p, st in optim.state.items():
        for k, v in st.items():
            if hasattr(v, "shape"):
                out[f"optim.{names[id(p)]}.{k}"] = _local(v)
    return out


def _local(t: Any) -> Any:
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


def state_bytes(model: Any, optim: Any) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(model, optim).values())


def tensor_bytes(t: Any) -> Any:
    """The bytes of ``t`` as a 1-D uint8 tensor (a view when ``t`` is contiguous): comparing two
    with ``torch.equal`` is a bit-for-bit comparison (NaN payloads and -0.0 included)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def byte_copies(tensors: dict[str, Any]) -> dict[str, Any]:
    """A copy of each tensor (for ``byte_mismatches`` in the same process)."""
    return {k: t.detach().clone() for k, t in tensors.items()}


def byte_mismatches(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Keys whose tensors differ in shape, dtype or any byte (``torch.equal`` on the bytes), or
    that only one side has."""
    import torch

    bad = [k for k in want if k not in got]
    for k, t in got.items():
        w = want.get(k)
        if w is None or t.shape != w.shape or t.dtype != w.dtype or not torch.equal(tensor_bytes(t), tensor_bytes(w)):
            bad.append(k)
    return bad


def byte_digest(t: Any) -> str:
    """``dtype shape sha256-of-the-bytes`` of ``t``: equal digests are equal bytes (checks
    across processes, where the saved tensors are gone; ~1.7 GB/s a core with SHA-NI)."""
    import hashlib

    return f"{t.dtype} {list(t.shape)} {hashlib.sha256(tensor_bytes(t).numpy()).hexdigest()}"


def digests(model: Any, optim: Any) -> dict[str, str]:
    """``byte_digest`` of every local tensor (DTensors: this rank's shard)."""
    return {k: byte_digest(t) for k, t in local_tensors(model, optim).items()}


def full_digests(model: Any, optim: Any) -> dict[str, str]:
    """``byte_digest`` of every full tensor (each DTensor gathered: collective, every rank in
    the same order); comparable across world sizes."""
    out = {}
    names = {}
    for n, p in model.named_parameters():
        names[id(p)] = n
        out["model." + n] = byte_digest(p.full_tensor() if hasattr(p, "full_tensor") else p)
    for p, st in optim.state.items():
        for k, v in st.items():
            if hasattr(v, "shape"):
                out[f"optim.{names[id(p)]}.{k}"] = byte_digest(v.full_tensor() if hasattr(v, "full_tensor") else v)
    return out


def compare_digests(got: dict[str, str], want: dict[str, str], what: str) -> None:
    """Raise unless ``got`` has exactly ``want``'s keys and digests (bit for bit)."""
    bad = [k for k in want if got.get(k) != want[k]] + [k for k in got if k not in want]
    if bad:
        raise AssertionError(
            f"{what}: {len(bad)} tensor(s) not restored bit for bit, e.g. {bad[:3]}: got {got.get(bad[0])} "
            f"want {want.get(bad[0])}"
        )


def scramble(model: Any, optim: Any) -> None:
    """Overwrite every local tensor in place (so a load that reads nothing is caught)."""
    import torch

    with torch.no_grad():
        for t in local_tensors(model, optim).values():
            t.fill_(0.5)


# --------------------------------------------------------------------------------------------
# unickpt metadata / events


def unickpt_bytes_per_rank(path: str) -> dict[int, int]:
    """Bytes each saving rank wrote (sum of shard/blob byte lengths, by data file ``rNNNNN``)."""
    from unickpt.format.codec import decode_metadata
    from unickpt.format.records import METADATA_FILE

    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        md = decode_metadata(f.read())
    per_file = [0] * len(md.files)
    for t in md.tensors.values():
        for s in t.shards:
            per_file[s.file_index] += s.byte_length
    for b in md.blobs.values():
        per_file[b.file_index] += b.byte_length
    out: dict[int, int] = {}
    for name, n in zip(md.files, per_file):
        rank = int(os.path.basename(name).split("-")[0].lstrip("r"))
        out[rank] = out.get(rank, 0) + n
    return out


class EventLog:
    """Collects unickpt monitoring events of this process (``unickpt.monitoring``)."""

    def __init__(self) -> None:
        import unickpt

        self.events: list[Any] = []  # since the last take()
        self.all: list[Any] = []  # every event
        self._lock = threading.Lock()
        unickpt.default_checkpointer().events.add_listener(self._on)

    def _on(self, ev: Any) -> None:
        with self._lock:
            self.events.append(ev)
            self.all.append(ev)

    def take(self) -> list[Any]:
        with self._lock:
            out, self.events = self.events, []
        return out


def phase_breakdown(events: Sequence[Any]) -> dict[str, float]:
    """Seconds of one unickpt save or load by phase, from its events on this rank.

    save: plan (``save.plan``), stage (end of plan -> start of write: binding / snapshotting
    the bytes), write (``save.write``: files written, checksummed, fsynced), commit (end of
    write -> ``save.end``: gather checksums, metadata, folder fsyncs, everyone agrees), total
    (``save.end``). load: metadata, plan (validation + load plan), read (``load.read``: reads,
    checksums, forwarding, copies), finish (end of read -> ``load.end``), total."""
    by = {}
    for e in events:
        by.setdefault(e.phase, []).append(e)

    def one(name: str) -> Any:
        return by[name][-1] if name in by else None

    out: dict[str, float] = {}
    if one("save.end") is not None:
        plan, write, end = one("save.plan"), one("save.write"), one("save.end")
        out["plan"] = plan.seconds if plan else float("nan")
        if write is not None:
            out["stage"] = write.t_start - (plan.t_end if plan else end.t_start)
            stage = one("save.stage")
            if stage is not None:
                out["stage"] = stage.seconds
            out["write"] = write.seconds
            out["commit"] = end.t_end - write.t_end
        out["total"] = end.seconds
    if one("load.end") is not None:
        md, plan, read, end = one("load.metadata"), one("load.plan"), one("load.read"), one("load.end")
        out["metadata"] = md.seconds if md else float("nan")
        out["plan"] = plan.seconds if plan else float("nan")
        out["read"] = read.seconds if read else float("nan")
        out["finish"] = end.t_end - read.t_end if read else float("nan")
        out["total"] = end.seconds
    return out


# --------------------------------------------------------------------------------------------
# printing


def fmt_s(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def fmt_gbs(nbytes: float, seconds: float) -> str:
    return "-" if not seconds or math.isnan(seconds) else f"{nbytes / seconds / GB:.2f}"


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]], left: Sequence[int] = (0,)) -> str:
    """A plain-text table: columns in ``left`` are left-aligned, the others right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        title,
        "  ".join(h.ljust(w) for h, w in zip(cells[0], widths)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    for r in cells[1:]:
        lines.append(
            "  ".join((c.ljust(w) if i in left else c.rjust(w)) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        )
    return "\n".join(lines)


def progress(msg: str) -> None:
    """A timestamped progress line on stderr (the results go to stdout)."""
    import sys

    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine_line() -> str:
    import torch

    load = os.getloadavg()
    return (
        f"machine: {os.cpu_count()} cores, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} "
        f"(other jobs share this machine), torch {torch.__version__}"
    )


def build_many_small(params: int, rows: int, seed: int, named: bool = False):
    """The many-small-tensors job of bench/many_small.py and bench/three_way.py: ``params``
    parameters of ``rows`` x 50 in units of 100, each unit and the root ``fully_shard``-ed,
    AdamW with its state made by one step (``named``: built from ``named_parameters``, so its
    param groups carry the names, as torchtitan builds it)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    class Unit(nn.Module):  # fully_shard wants modules with a forward
        def __init__(self, n: int) -> None:
            super().__init__()
            self.ps = nn.ParameterList(nn.Parameter(torch.randn(rows, 50)) for _ in range(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + sum(p.sum() for p in self.ps)

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.units = nn.ModuleList(Unit(min(100, params - g)) for g in range(0, params, 100))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for u in self.units:
                x = u(x)
            return x

    torch.manual_seed(seed)
    model = Root()
    for unit in model.units:
        fully_shard(unit)
    fully_shard(model)
    optim = torch.optim.AdamW(model.named_parameters() if named else model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    optim.zero_grad()
    return model, optim
