"""Checkpoint stall in a real training loop, durable save, cold / resharding load, read
redundancy, plan cache and peak memory: unickpt vs PyTorch DCP (issue #4).

State and training: a stack of ``nn.Linear(d, d, bias=False)`` (d = 4096) with FSDP2
(``fully_shard`` per layer and the root, ``reshard_after_forward=False`` to spare one
all-gather per step on this slow CPU/gloo machine) at ``--world-size`` gloo ranks on CPU and Adam; fp32
params + exp_avg + exp_avg_sq = ``--gib`` GiB in total. Every rank trains on the same small
batch (so every step does the same work); one step = forward, backward (FSDP2 all-gather /
reduce-scatter), ``optimizer.step()``.

1. Stall (lost training time per checkpoint). After ``--warmup`` steps, for every method and
   every repeat, two adjacent windows of ``--window`` steps are timed (barrier to barrier): one
   without a save and one whose first step issues an asynchronous save. The save must be durable
   by the end of its window: the window ends with ``handle.wait()`` / ``future.result()``, so a
   save still running then is waited for and counted. stall = window with save - the adjacent
   window without (median over repeats); the order of the two windows alternates between
   repeats. Methods:
     - unickpt ``save(..., async_save=True)``;
     - DCP ``dcp.async_save`` variants that work on CPU in torch 2.13 (``--dcp-variants``):
       ``default`` (no stager: a deep copy into fresh memory in the call, THREAD checkpointer),
       ``thread-cached`` (a reused ``DefaultStager(StagingOptions(use_pinned_memory=False,
       use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False))``: copies
       into storages cached from the previous save), ``thread-async`` (the same stager with
       ``use_async_staging=True``: the copy runs on a background thread; the training loop waits
       for ``staging_completion`` before the next ``optimizer.step()`` so the snapshot is
       consistent) and ``process`` (``AsyncCheckpointerType.PROCESS``, reused stager with
       ``use_shared_memory=True`` so the snapshot reaches the checkpoint process without a copy).
       DCP's async saves run on a gloo group of their own (as its docs advise). ``process`` is
       not in the default list: its first save spawns the checkpoint process (~7 s here) and
       with 0.5 GiB it stalled more than the thread variants; add it with ``--dcp-variants``.
   Every method first makes one untimed save with no training meanwhile (first-save costs:
   planning, staging buffers, DCP's checkpoint process), reported apart.
   "blocks" is the time the save call itself takes (plus, for thread-async, the wait for staging
   before the next optimizer step).
2. Durable blocking save: unickpt ``save`` vs ``get_state_dict`` + ``dcp.save`` vs the raw disk
   (each rank writes the bytes of its unickpt share: buffered write + fsync; O_DIRECT 16 MiB
   aligned writes from pre-touched buffers, one thread per file), interleaved, fresh folders.
3. Cold loads (every checkpoint file evicted from the page cache with
   ``posix_fadvise(DONTNEED)`` before each, every local tensor overwritten before and checked
   bit for bit after, untimed: SHA-256 of each local tensor's bytes, of each full tensor's
   after a resharding load, ``_common.digests`` / ``full_digests``): same layout (unickpt
   ``load``; DCP ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``); resharding in fresh
   processes to half the world size (ws 2 -> 1: one process without a process group and a
   plain model, framework="torch"; ws 4 -> 2: FSDP2),
   compared with a same-layout load at that new world size too (the loaded state saved there
   by each library and loaded back cold), so that the ratio compares equal reader counts.
4. Bytes read from storage by a DDP load at ``--ddp-world-size`` ranks (state ``--ddp-gib``),
   unickpt with the default (auto: one host over local files reads locally, sharing the page
   cache), ``dedup_reads=True`` (each byte read by one rank and forwarded) and ``False``:
   unickpt = sum over ranks of the ``nbytes`` of its ``load.read`` events; DCP = bytes its
   ``FileSystemReader`` asked for (a subclass counting the stored length of every read item);
   both also as ``/proc/self/io`` ``read_bytes`` deltas summed over ranks (bytes the kernel
   fetched from the device: concurrent readers of one cold page share one fetch).
5. Plan cache: seconds of the ``save.plan`` phase (unickpt events) of the first save vs later.
6. Memory per rank: psutil RSS sampled every 5 ms inside each operation (before / peak / after)
   and ``ru_maxrss``, next to the rank's local state size.

Usage:  python bench/async_stall.py [--gib 2] [--repeats 3] [--world-size 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    EventLog,
    GiB,
    PeakRSS,
    RawBuffer,
    barrier,
    build_model,
    compare_digests,
    digests,
    dir_bytes,
    evict,
    fmt_gbs,
    fmt_s,
    full_digests,
    gather,
    machine_line,
    make_tmp,
    maxrss,
    median,
    model_shape,
    phase_breakdown,
    progress,
    raw_read,
    raw_write_buffered,
    raw_write_direct,
    rmtree,
    rss,
    scramble,
    spawn,
    state_bytes,
    table,
    timed,
    unickpt_bytes_per_rank,
)

DCP_VARIANTS = ("default", "thread-cached", "thread-async", "process")


def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*pin_memory.*")


def _batch(dim: int, seed: int = 1):
    import torch

    return torch.randn(8, dim, generator=torch.Generator().manual_seed(seed))


def _dcp_sd(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _dcp_load(model, optim, path: str, reader=None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = _dcp_sd(model, optim)
    if reader is None:
        dcp.load(sd, checkpoint_id=path)
    else:
        dcp.load(sd, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class _Saver:
    """One async-save method: ``start(path)`` issues the save; ``before_step(h)`` runs before the
    next optimizer step (waits for a background snapshot); ``finish(h)`` waits for durability;
    ``done_at`` is the ``perf_counter`` time at which the last save became durable."""

    name = ""
    done_at = float("nan")

    def start(self, path: str):
        raise NotImplementedError

    def before_step(self, h) -> None:
        pass

    def finish(self, h) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _UnickptSaver(_Saver):
    name = "unickpt async_save"

    def __init__(self, state: dict) -> None:
        import unickpt

        self.state = state
        unickpt.default_checkpointer().events.add_listener(
            self._on_event
        )  # "save.end": emitted by the background worker at commit

    def _on_event(self, ev) -> None:
        if ev.phase == "save.end":
            self.done_at = ev.t_end

    def start(self, path: str):
        import unickpt

        self.done_at = float("nan")
        return unickpt.save(path, self.state, framework="fsdp2", async_save=True)

    def finish(self, h) -> None:
        h.wait()


class _DCPSaver(_Saver):
    def __init__(self, variant: str, model, optim, group) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.name = f"DCP async_save [{variant}]"
        self.variant, self.model, self.optim, self.group = variant, model, optim, group
        self.kind = AsyncCheckpointerType.PROCESS if variant == "process" else AsyncCheckpointerType.THREAD
        self.stager = None
        if variant != "default":
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=variant == "process",
                    use_async_staging=variant == "thread-async",
                    use_non_blocking_copy=False,
                )
            )

    def start(self, path: str):
        import torch.distributed.checkpoint as dcp

        self.done_at = float("nan")
        h = dcp.async_save(
            _dcp_sd(self.model, self.optim),
            checkpoint_id=path,
            process_group=self.group,
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )
        (h.upload_completion if hasattr(h, "upload_completion") else h).add_done_callback(self._done)
        return h

    def _done(self, _f) -> None:
        self.done_at = time.perf_counter()

    def before_step(self, h) -> None:
        if hasattr(h, "staging_completion"):
            h.staging_completion.result()

    def finish(self, h) -> None:
        (h.upload_completion if hasattr(h, "upload_completion") else h).result()

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def rank_main(rank: int, ws: int, cfg: dict) -> dict:
    """Sections 1-3 and 5-6 at the training world size."""
    import torch.distributed as dist

    import unickpt

    _quiet()
    tmp, layers, dim, W, R = cfg["tmp"], cfg["layers"], cfg["dim"], cfg["window"], cfg["repeats"]
    mem = PeakRSS()
    log = EventLog()
    rss0 = rss()
    model, optim = build_model(layers, dim, seed=0, fsdp2=True, reshard_after_forward=False)
    state = {"model": model, "optimizer": optim}
    x = _batch(dim)
    my_state = state_bytes(model, optim) if optim.state else 0

    def step(before_optim=None) -> None:
        loss = model(x).square().mean()
        loss.backward()
        if before_optim is not None:
            before_optim()
        optim.step()
        optim.zero_grad(set_to_none=True)

    step_times = []
    for _ in range(cfg["warmup"]):
        step_times.append(timed(step)[0])
    my_state = state_bytes(model, optim)
    rss_trained = rss()

    def fresh(path: str) -> None:
        if rank == 0:
            rmtree(path)
        barrier()

    if rank == 0:
        progress(f"warm-up done ({median(step_times):.2f} s/step); first saves")
    # ---- 1. stall windows
    dcp_group = dist.new_group(backend="gloo")
    savers: list[_Saver] = [_UnickptSaver(state)]
    # DCP's default variant last in the first-save pass: it frees its copy after the save and
    # glibc would hand those pages to the next variant, hiding that variant's own allocation
    variants = sorted(cfg["dcp_variants"], key=lambda v: v == "default")
    savers += [_DCPSaver(v, model, optim, dcp_group) for v in variants]
    stall: dict[str, dict[str, list[float]]] = {
        s.name: {"with": [], "without": [], "blocks": [], "save_s": []} for s in savers
    }
    errors: dict[str, str] = {}
    first: dict[str, dict[str, float]] = {}

    def note_error(s: _Saver, e: Exception) -> None:
        import traceback

        errors[s.name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if rank == 0:
            traceback.print_exc()

    # warm-up: one isolated save per method, no training meanwhile (first-save costs: plans,
    # staging buffers, DCP's checkpoint process); also the memory of one async save
    for s in savers:
        path = os.path.join(tmp, "first")
        fresh(path)
        try:
            barrier()
            t0 = time.perf_counter()
            with mem.region(f"first async save (call + wait): {s.name}"):
                h = s.start(path)
                t_call = time.perf_counter() - t0
                s.before_step(h)
                s.finish(h)
            barrier()
            first[s.name] = {"call": t_call, "total": time.perf_counter() - t0}
        except Exception as e:  # report a variant that does not work on CPU, go on
            note_error(s, e)
    fresh(os.path.join(tmp, "first"))

    def window(saver: _Saver | None, path: str) -> tuple[float, float, float]:
        barrier()
        t0 = time.perf_counter()
        blocked, h, t_issue = 0.0, None, 0.0
        for i in range(W):
            if i == 0 and saver is not None:
                t_issue = time.perf_counter()
                h = saver.start(path)
                blocked += time.perf_counter() - t_issue
            if h is not None and i == 0:

                def wait_snapshot(h: object = h) -> None:
                    nonlocal blocked
                    tb = time.perf_counter()
                    saver.before_step(h)
                    blocked += time.perf_counter() - tb

                step(wait_snapshot)
            else:
                step()
        if h is not None:
            saver.finish(h)
        save_s = saver.done_at - t_issue if h is not None else 0.0
        barrier()
        return time.perf_counter() - t0, blocked, save_s

    for r in range(R):
        if rank == 0:
            progress(f"stall windows, repeat {r + 1}/{R}")
        order = savers[r % len(savers) :] + savers[: r % len(savers)]
        for s in order:
            if s.name in errors:
                continue
            path = os.path.join(tmp, "stall")
            fresh(path)
            try:
                pair = [None, s] if r % 2 == 0 else [s, None]
                for which in pair:
                    t, blocked, save_s = window(which, path)
                    d = stall[s.name]
                    if which is None:
                        d["without"].append(t)
                    else:
                        d["with"].append(t)
                        d["blocks"].append(blocked)
                        d["save_s"].append(save_s)
            except Exception as e:
                note_error(s, e)
    fresh(os.path.join(tmp, "stall"))
    for s in savers:
        s.close()

    # ---- 2. durable blocking saves
    if rank == 0:
        progress("durable saves")
    upath, dpath = os.path.join(tmp, "unickpt"), os.path.join(tmp, "dcp")
    rawdir = os.path.join(tmp, "raw")
    if rank == 0:
        os.makedirs(rawdir, exist_ok=True)
    parts = cfg["files_per_rank"]
    bufs = [RawBuffer(seed=rank * 16 + i) for i in range(parts)]
    fresh(upath)
    with mem.region("unickpt blocking save"):
        timed(lambda: unickpt.save(upath, state, framework="fsdp2"))
    per_rank = gather(unickpt_bytes_per_rank(upath) if rank == 0 else None)[0]
    share = per_rank[rank]
    buf_file = os.path.join(rawdir, f"r{rank}-buffered.bin")
    direct_files = [os.path.join(rawdir, f"r{rank}-direct-{i}.bin") for i in range(parts)]

    def unlink(paths: list[str]) -> None:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
        barrier()

    def dcp_save() -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(_dcp_sd(model, optim), checkpoint_id=dpath)

    durable = {"unickpt": [], "dcp": [], "raw_buffered": [], "raw_direct": []}
    phases: dict[str, list[dict[str, float]]] = {"save": [], "load": []}
    ops = [
        ("unickpt", lambda: fresh(upath), lambda: unickpt.save(upath, state, framework="fsdp2")),
        ("dcp", lambda: fresh(dpath), dcp_save),
        ("raw_buffered", lambda: unlink([buf_file]), lambda: raw_write_buffered(buf_file, share, bufs[0])),
        ("raw_direct", lambda: unlink(direct_files), lambda: raw_write_direct(direct_files, share, bufs)),
    ]
    fresh(dpath)
    with mem.region("DCP blocking save"):
        timed(dcp_save)  # warm-up (DCP's first save plans)
    for r in range(R):
        for name, prepare, op in ops[r % len(ops) :] + ops[: r % len(ops)]:
            prepare()
            log.take()
            durable[name].append(timed(op)[0])
            if name == "unickpt":
                phases["save"].append(phase_breakdown(log.take()))
    unlink([buf_file])

    want = digests(model, optim)  # this rank's shards, bit for bit (same-layout loads)
    ref_full = full_digests(model, optim)  # every full tensor (resharding loads; collective)

    # ---- 3a. cold loads, same layout
    if rank == 0:
        progress("cold loads")

    def cold() -> None:
        if rank == 0:
            evict([upath, dpath, rawdir])
        barrier()

    loads = {"unickpt": [], "dcp": [], "raw_read": []}
    lops = [
        ("unickpt", lambda: unickpt.load(upath, state, framework="fsdp2")),
        ("dcp", lambda: _dcp_load(model, optim, dpath)),
        ("raw_read", lambda: raw_read(direct_files, bufs)),
    ]
    for r in range(R):
        for name, op in lops[r % len(lops) :] + lops[: r % len(lops)]:
            if name != "raw_read":
                scramble(model, optim)
            cold()
            with mem.region(f"{name} cold load"):
                log.take()
                loads[name].append(timed(op)[0])
                if name == "unickpt":
                    phases["load"].append(phase_breakdown(log.take()))
            if name != "raw_read":
                compare_digests(digests(model, optim), want, f"rank {rank}: {name} load")
    for b in bufs:
        b.close()
    if rank == 0:
        rmtree(rawdir)

    plan_events = [(e.save_id, e.seconds) for e in log.all if e.phase == "save.plan"]
    stage_events = [(e.seconds, e.nbytes) for e in log.all if e.phase == "save.stage"]
    out = {
        "step_times": step_times,
        "stall": stall,
        "errors": errors,
        "first": first,
        "durable": durable,
        "loads": loads,
        "per_rank": per_rank,
        "plan": plan_events,
        "stage": stage_events,
        "phases": phases,
        "state_bytes": my_state,
        "ubytes": dir_bytes(upath),
        "dbytes": dir_bytes(dpath),
        "mem": mem.regions,
        "maxrss": maxrss(),
        "rss0": rss0,
        "rss_trained": rss_trained,
        "rss_end": rss(),
        "digests": ref_full if rank == 0 else None,
    }
    mem.close()
    dist.barrier()
    return out


def reshard_main(rank: int, ws: int, cfg: dict, want: dict) -> dict:
    """Cold loads of both checkpoints at a new world size (ws 1: no process group)."""
    import torch.distributed as dist

    import unickpt

    _quiet()
    fsdp2 = dist.is_initialized()
    mem = PeakRSS()
    model, optim = build_model(cfg["layers"], cfg["dim"], seed=1, fsdp2=fsdp2)
    loss = model(_batch(cfg["dim"], 2)).square().mean()
    loss.backward()
    optim.step()  # creates the Adam state
    optim.zero_grad(set_to_none=True)
    state = {"model": model, "optimizer": optim}
    upath, dpath = os.path.join(cfg["tmp"], "unickpt"), os.path.join(cfg["tmp"], "dcp")
    fw = "fsdp2" if fsdp2 else "torch"
    times = {"unickpt": [], "dcp": []}
    log = EventLog()
    phases: list[dict[str, float]] = []

    def cold_loads(ops: list, paths: list[str], what: str, record: bool) -> None:
        """Interleaved cold loads (order alternating per repeat), each checked; ``record``:
        also the memory region and unickpt's phases."""
        for r in range(cfg["repeats"]):
            for name, op in ops if r % 2 == 0 else ops[::-1]:
                scramble(model, optim)
                if rank == 0:
                    evict(paths)
                barrier()
                if not record:
                    times[name].append(timed(op)[0])
                else:
                    with mem.region(f"{name} reshard load"):
                        log.take()
                        times[name].append(timed(op)[0])
                        if name == "unickpt":
                            phases.append(phase_breakdown(log.take()))
                compare_digests(full_digests(model, optim), want, f"rank {rank}: {name} {what}")

    cold_loads(
        [
            ("unickpt", lambda: unickpt.load(upath, state, framework=fw)),
            ("dcp", lambda: _dcp_load(model, optim, dpath)),
        ],
        [upath, dpath],
        "resharding load",
        True,
    )

    # same-layout baseline at this world size: save what was loaded, load it back cold
    import torch.distributed.checkpoint as dcp

    u1, d1 = os.path.join(cfg["tmp"], "unickpt-new-ws"), os.path.join(cfg["tmp"], "dcp-new-ws")
    unickpt.save(u1, state, framework=fw)
    dcp.save(_dcp_sd(model, optim), checkpoint_id=d1)
    times.update({"unickpt same": [], "dcp same": []})
    cold_loads(
        [
            ("unickpt same", lambda: unickpt.load(u1, state, framework=fw)),
            ("dcp same", lambda: _dcp_load(model, optim, d1)),
        ],
        [u1, d1],
        "load",
        False,
    )
    barrier()
    if rank == 0:
        rmtree(u1)
        rmtree(d1)
    out = {"times": times, "phases": phases, "mem": mem.regions, "state_bytes": state_bytes(model, optim)}
    mem.close()
    return out


def ddp_main(rank: int, ws: int, cfg: dict) -> dict:
    """Section 4: bytes read from storage by a DDP load (every rank needs the whole state)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.nn.parallel import DistributedDataParallel

    import unickpt

    _quiet()
    layers, dim = cfg["ddp_layers"], cfg["ddp_dim"]
    tmp = os.path.join(cfg["tmp"], "ddp")
    upath, dpath = os.path.join(tmp, "unickpt"), os.path.join(tmp, "dcp")
    torch.manual_seed(0)
    inner, _ = build_model(layers, dim, seed=0, fsdp2=False)
    model = DistributedDataParallel(inner)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss = model(_batch(dim)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    state = {"model": model, "optimizer": optim}
    unickpt.save(upath, state, framework="ddp")
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_sd(model, optim), checkpoint_id=dpath)
    want = digests(model, optim)
    log = EventLog()

    class CountingReader(FileSystemReader):
        nbytes = 0

        def read_data(self, plan, planner):
            for item in plan.items:
                CountingReader.nbytes += self.storage_data[item.storage_index].length
            return super().read_data(plan, planner)

    def io_read() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))

    def run(name: str, op) -> dict:
        scramble(model, optim)
        if rank == 0:
            evict([tmp])
        barrier()
        log.take()
        before = io_read()
        t, _ = timed(op)
        got = io_read() - before
        compare_digests(digests(model, optim), want, f"rank {rank}: DDP {name} load")
        evs = log.take()
        return {
            "seconds": t,
            "proc_io": got,
            "phases": phase_breakdown(evs),
            "events": sum(e.nbytes for e in evs if e.phase == "load.read"),
        }

    def dcp_load() -> None:
        CountingReader.nbytes = 0
        _dcp_load(model, optim, dpath, CountingReader(dpath))

    from unickpt import LoadOptions
    from unickpt.options import ReadOptions

    ops = [
        ("unickpt (dedup auto)", lambda: unickpt.load(upath, state, framework="ddp")),
        (
            "unickpt dedup_reads=True",
            lambda: unickpt.load(upath, state, framework="ddp", options=LoadOptions(io=ReadOptions(dedup_reads=True))),
        ),
        (
            "unickpt dedup_reads=False",
            lambda: unickpt.load(upath, state, framework="ddp", options=LoadOptions(io=ReadOptions(dedup_reads=False))),
        ),
        ("DCP", dcp_load),
    ]
    out: dict = {name: [] for name, _ in ops}
    for r in range(cfg["repeats"]):
        for name, op in ops[r % len(ops) :] + ops[: r % len(ops)]:
            res = run(name, op)
            if name == "DCP":
                res["logical"] = CountingReader.nbytes
            out[name].append(res)
    size = unickpt_bytes_per_rank(upath) if rank == 0 else None
    return {
        "runs": out,
        "ckpt_bytes": sum(size.values()) if size else None,
        "ubytes": dir_bytes(upath),
        "dbytes": dir_bytes(dpath),
    }


def _gib(n: float) -> str:
    return f"{n / GiB:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="total state size (params + Adam), GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--dir", default=None, help="parent of the temporary folder (default /tmp)")
    ap.add_argument(
        "--window", type=int, default=1, help="training steps per timed window (a 2 GiB step takes seconds here)"
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--dcp-variants",
        default="default,thread-cached,thread-async",
        help=f"comma-separated subset of {','.join(DCP_VARIANTS)}",
    )
    ap.add_argument("--ddp-gib", type=float, default=0.25)
    ap.add_argument("--ddp-world-size", type=int, default=4)
    ap.add_argument(
        "--files-per-rank", type=int, default=2, help="unickpt's default; also the raw O_DIRECT writer's file count"
    )
    args = ap.parse_args()
    layers, dim = model_shape(args.gib)
    ddp_layers, ddp_dim = model_shape(args.ddp_gib)
    total = layers * dim * dim * 12
    variants = [v for v in args.dcp_variants.split(",") if v]
    bad = set(variants) - set(DCP_VARIANTS)
    if bad:
        raise SystemExit(f"unknown DCP variants {sorted(bad)}")
    ws = args.world_size
    tmp = make_tmp(args.dir, 4 * total)
    cfg = {
        "tmp": tmp,
        "layers": layers,
        "dim": dim,
        "repeats": args.repeats,
        "window": args.window,
        "warmup": args.warmup,
        "dcp_variants": variants,
        "files_per_rank": args.files_per_rank,
        "ddp_layers": ddp_layers,
        "ddp_dim": ddp_dim,
    }
    print(
        f"unickpt async-stall benchmark: {layers} x Linear({dim}, {dim}) + Adam = "
        f"{total / GiB:.3f} GiB, FSDP2 at world size {ws}, window {args.window} steps, "
        f"{args.repeats} repeats, folder {tmp}"
    )
    print(machine_line())
    print("writes: fsync'ed; reads: cold (page cache evicted)")
    t0 = time.perf_counter()
    ws2 = ws // 2
    try:
        res = spawn(rank_main, ws, cfg)
        r0 = res[0]
        t1 = time.perf_counter()
        rs = spawn(reshard_main, ws2 if ws2 > 1 else 0, cfg, r0["digests"])
        t2 = time.perf_counter()
        dd = spawn(ddp_main, args.ddp_world_size, cfg)
        t3 = time.perf_counter()
    finally:
        rmtree(tmp)
    print(
        f"(ran in {time.perf_counter() - t0:.0f} s: main {t1 - t0:.0f} s, reshard {t2 - t1:.0f} s, "
        f"DDP {t3 - t2:.0f} s; temporary folder removed)\n"
    )

    # ---- 1. stall
    # one training step alone: the windows without a save (every method's), per step
    step = median([t / args.window for d in r0["stall"].values() for t in d["without"]])
    rows, stalls = [], {}
    for name, d in r0["stall"].items():
        if not d["with"]:
            rows.append([name, "failed", "", "", "", "", "", ""])
            continue
        diffs = [a - b for a, b in zip(d["with"], d["without"])]
        s = median(diffs)
        stalls[name] = s
        f = r0["first"].get(name, {})
        rows.append(
            [
                name,
                fmt_s(median(d["without"])),
                fmt_s(median(d["with"])),
                fmt_s(s),
                f"{s / step:.2f}",
                fmt_s(median(d["blocks"])),
                fmt_s(median(d["save_s"])),
                " ".join(f"{x:+.2f}" for x in diffs),
                f"{f.get('call', float('nan')):.3f} / {f.get('total', float('nan')):.3f}",
            ]
        )
    print(
        table(
            f"1. Stall per checkpoint (training step alone: {step:.3f} s median; "
            f"window = {args.window} steps; median of {args.repeats}; stall = window with save "
            "- adjacent window without; blocks = save call (+ wait for the snapshot before "
            "the next optimizer step); durable after = issue -> committed)",
            [
                "method",
                "window s",
                "window+save s",
                "stall s",
                "stall/step",
                "blocks s",
                "durable after s",
                "per-repeat stall s",
                "first save (no training): call / total s",
            ],
            rows,
        )
    )
    for name, e in r0["errors"].items():
        print(f"  {name} failed: {e}")
    st = r0["stage"][1:]  # the first one allocates the staging buffers
    if st:
        secs, nb = median([x[0] for x in st]), median([x[1] for x in st])
        print(
            f"unickpt snapshot (save.stage, rank 0, saves after the first): median {secs:.3f} s for "
            f"{nb / GiB:.3f} GiB = {nb / secs / 1e9:.1f} GB/s; first {r0['stage'][0][0]:.3f} s"
        )
    dcp_stalls = {k: v for k, v in stalls.items() if k.startswith("DCP")}
    u_name = "unickpt async_save"
    if dcp_stalls and u_name in stalls:
        best = min(dcp_stalls, key=dcp_stalls.get)
        print(
            f"best DCP variant: {best}; unickpt stall / best DCP stall = "
            f"{stalls[u_name] / dcp_stalls[best]:.2f} (target <= 0.10)"
        )
        best_dcp_blocks = median(r0["stall"][best]["blocks"])
        print(
            f"save call blocks: unickpt {median(r0['stall'][u_name]['blocks']):.3f} s, best DCP {best_dcp_blocks:.3f} s"
        )

    # ---- 2. durable saves
    du, per = r0["durable"], r0["per_rank"]
    ub, db, rb = r0["ubytes"], r0["dbytes"], sum(per.values())

    def row(op: str, xs: list[float], nbytes: int) -> list[str]:
        m = median(xs)
        return [op, fmt_s(m), fmt_s(min(xs)), fmt_s(max(xs)), _gib(nbytes), fmt_gbs(nbytes, m)]

    print()
    print(
        table(
            f"2. Durable blocking save (fsync'ed; median of {args.repeats})",
            ["op", "median s", "min s", "max s", "GiB", "GB/s"],
            [
                row("unickpt save", du["unickpt"], ub),
                row("DCP save", du["dcp"], db),
                row("raw write buffered+fsync", du["raw_buffered"], rb),
                row(f"raw write O_DIRECT ({args.files_per_rank} files/rank)+fsync", du["raw_direct"], rb),
            ],
        )
    )
    sp = median(du["dcp"]) / median(du["unickpt"])
    u_bw = ub / median(du["unickpt"])
    print(
        f"unickpt save speedup over DCP: {sp:.2f}x (target >= 1.5x); unickpt GB/s / raw buffered: "
        f"{u_bw / (rb / median(du['raw_buffered'])):.2f}, / raw O_DIRECT: "
        f"{u_bw / (rb / median(du['raw_direct'])):.2f} (target >= 0.8)"
    )

    # ---- 3. loads
    ld, rt = r0["loads"], rs[0]["times"]
    print()
    print(
        table(
            f"3. Cold loads (median of {args.repeats})",
            ["op", "median s", "min s", "max s", "GiB", "GB/s"],
            [
                row(f"unickpt load ws={ws} (same layout)", ld["unickpt"], ub),
                row(f"DCP load ws={ws} (same layout)", ld["dcp"], db),
                row("raw cold read", ld["raw_read"], rb),
                row(f"unickpt reshard load {ws} -> {max(ws2, 1)}", rt["unickpt"], ub),
                row(f"DCP reshard load {ws} -> {max(ws2, 1)}", rt["dcp"], db),
                row(f"unickpt load ws={max(ws2, 1)} (same layout, saved at {max(ws2, 1)})", rt["unickpt same"], ub),
                row(f"DCP load ws={max(ws2, 1)} (same layout, saved at {max(ws2, 1)})", rt["dcp same"], db),
            ],
        )
    )
    print(
        f"load speedup over DCP: same layout {median(ld['dcp']) / median(ld['unickpt']):.2f}x, "
        f"resharding {median(rt['dcp']) / median(rt['unickpt']):.2f}x"
    )
    w2 = max(ws2, 1)
    print(
        f"resharding load {ws} -> {w2} / same-layout load at ws={w2}: unickpt "
        f"{median(rt['unickpt']) / median(rt['unickpt same']):.2f} (target <= 1.1), DCP "
        f"{median(rt['dcp']) / median(rt['dcp same']):.2f}"
    )
    print(
        f"resharding load {ws} -> {w2} / same-layout load at ws={ws}: unickpt "
        f"{median(rt['unickpt']) / median(ld['unickpt']):.2f}, DCP {median(rt['dcp']) / median(ld['dcp']):.2f}"
    )
    print(f"unickpt load GB/s / raw cold read GB/s: {(ub / median(ld['unickpt'])) / (rb / median(ld['raw_read'])):.2f}")

    # ---- 4. DDP read bytes
    ckpt = dd[0]["ckpt_bytes"]
    drows = []
    for name in dd[0]["runs"]:
        runs = [r["runs"][name] for r in dd]  # per rank, per repeat
        lib = sum(x[0]["logical" if name == "DCP" else "events"] for x in runs)
        pio = median([sum(x[i]["proc_io"] for x in runs) for i in range(len(runs[0]))])
        secs = median([x["seconds"] for x in runs[0]])
        drows.append([name, lib, f"{lib / ckpt:.2f}x", int(pio), f"{pio / ckpt:.2f}x", fmt_s(secs)])
    print()
    print(
        table(
            f"4. Bytes read from storage, DDP load at ws={args.ddp_world_size} "
            f"(checkpoint tensor bytes {ckpt} = {_gib(ckpt)} GiB; cold; load s = median of "
            f"{args.repeats})",
            ["method", "bytes read (library's count)", "/ ckpt", "/proc/self/io read_bytes", "/ ckpt", "load s"],
            drows,
        )
    )
    print(
        "  unickpt: sum over ranks of its load.read event nbytes; DCP: sum over ranks of the stored "
        "length of every item FileSystemReader.read_data was asked for (a counting subclass); "
        "read_bytes: kernel's per-process count of bytes fetched from the device, summed over "
        "ranks (median over repeats; a cold page read by several ranks at once is fetched, and "
        "counted, once)"
    )
    ph = [r["runs"]["unickpt dedup_reads=True"][-1]["phases"] for r in dd]
    print(
        "  unickpt DDP load phases, dedup_reads=True (last repeat): "
        + "; ".join(f"rank {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in p.items()) for i, p in enumerate(ph))
    )

    # ---- 5. plan cache
    plans = r0["plan"]
    if plans:
        first, later = plans[0][1], [s for _, s in plans[1:]]
        print()
        print(
            f"5. Plan cache (rank 0 save.plan phase): first save {first * 1e3:.1f} ms, later saves "
            f"median {median(later) * 1e3:.1f} ms (min {min(later) * 1e3:.1f}, max "
            f"{max(later) * 1e3:.1f}, n={len(later)})"
            if later
            else f"5. first save plan {first:.3f} s"
        )

    prow = []
    for rank, r in enumerate(res):
        for kind in ("save", "load"):
            runs = r["phases"][kind]
            if runs:
                prow.append(
                    [rank, f"unickpt {kind}", ", ".join(f"{k} {median([x[k] for x in runs]):.3f}" for k in runs[0])]
                )
    for rank, r in enumerate(rs):
        if r["phases"]:
            prow.append(
                [
                    f"{rank} (ws {max(ws2, 1)})",
                    "unickpt reshard load",
                    ", ".join(f"{k} {median([x[k] for x in r['phases']]):.3f}" for k in r["phases"][0]),
                ]
            )
    print()
    print(
        table(
            "unickpt phases per rank, blocking save and cold loads (seconds, median; from its events)",
            ["rank", "op", "phases"],
            prow,
            left=(0, 1, 2),
        )
    )

    # ---- 6. memory
    print()
    mrows = []
    for who, group in ((str, res), (lambda k: f"{k} (ws {max(ws2, 1)})", rs)):
        for rank, r in enumerate(group):
            sb = r["state_bytes"]
            for label, occ in r["mem"].items():
                before = occ[0][0]
                peak = max(o[1] - o[0] for o in occ)
                kept = occ[0][2] - occ[0][0]
                mrows.append(
                    [
                        who(rank),
                        label,
                        _gib(sb),
                        _gib(before),
                        _gib(peak),
                        f"{peak / sb:.2f}",
                        _gib(kept),
                        f"{kept / sb:.2f}",
                    ]
                )
    print(
        table(
            "6. Host memory per rank (psutil RSS sampled every 5 ms inside each operation): "
            "extra = max over occurrences of (peak - RSS before); kept = RSS after - before "
            "(first occurrence); x = / the rank's state bytes",
            ["rank", "operation", "state GiB", "RSS before GiB", "extra GiB", "x state", "kept GiB", "x state"],
            mrows,
        )
    )
    for rank, r in enumerate(res):
        print(
            f"rank {rank}: local state {_gib(r['state_bytes'])} GiB; RSS at start {_gib(r['rss0'])}, "
            f"after warm-up training {_gib(r['rss_trained'])}, at end {_gib(r['rss_end'])} GiB; "
            f"ru_maxrss {_gib(r['maxrss'])} GiB"
        )
    print("bytes written per rank by unickpt: " + ", ".join(f"rank {k}: {_gib(v)} GiB" for k, v in sorted(per.items())))


if __name__ == "__main__":
    main()
