"""Blocking save / cold load / resharding load: unickpt vs PyTorch DCP vs the raw disk (issue #2).

What runs (one invocation, all numbers from the same run):

* State: a stack of ``nn.Linear(d, d, bias=False)`` layers (d = 4096 unless ``--gib`` is tiny),
  FSDP2 (``fully_shard`` on every layer and the root) at ``--world-size`` gloo ranks (CPU), Adam
  with its state created by one training step on a tiny batch: fp32 params + exp_avg +
  exp_avg_sq = ``--gib`` GiB in total (12 bytes per parameter).
* Saves, at the saving world size, each into a fresh folder (the previous one is removed outside
  the timed region), interleaved A, B, raw, raw, A, B, ... and repeated ``--repeats`` times after
  one untimed warm-up save of each (reported separately as "first save"):
    - unickpt: ``unickpt.save(path, {"model", "optimizer"}, framework="fsdp2")`` (blocking:
      returns once committed; unickpt fsyncs its files and folders);
    - DCP: ``get_state_dict(model, optim)`` + ``dcp.save({"model", "optim"}, checkpoint_id=dir)``
      (default FileSystemWriter: one file per rank, ``sync_files=True``, i.e. fsync);
    - raw disk: every rank writes exactly the bytes of its unickpt share (from the metadata)
      (a) buffered ``write`` in 16 MiB calls + fsync, one file, (b) O_DIRECT, aligned 16 MiB
      ``pwrite`` calls from a pre-touched buffer, split over ``files_per_rank`` files written by
      one thread each (as unickpt does), + fsync.
* Loads (cold: before each one every checkpoint file is evicted from the page cache with
  ``posix_fadvise(DONTNEED)``; every local tensor is overwritten first and checked bit for bit
  after, untimed: SHA-256 of its bytes, ``_common.digests``):
    - same layout at the saving world size: ``unickpt.load(..., framework="fsdp2")``, and again
      with ``StorageOptions(direct_reads=True)`` (O_DIRECT reads);
      DCP ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``; raw: the raw O_DIRECT files
      read (a) buffered, one thread per file, 16 MiB ``preadv`` into pre-touched buffers, and
      (b) with O_DIRECT by 4 threads per rank, 16 MiB chunks (the deep queue the device likes);
    - resharding: one process without a process group loads the checkpoints into a plain
      (unsharded) model + Adam: ``unickpt.load(..., framework="torch")`` and
      ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``. Checked bit for bit against every
      full tensor saved (``_common.full_digests``).
* Timing: barrier, operation, barrier, on rank 0; the table gives the median over the repeats,
  and min/max. GB/s = bytes of that checkpoint (or raw bytes) / seconds, GB = 1e9. Ratios are
  given two ways: of the medians, and "paired" (median over repeats of the ratio of the two runs
  of one repeat, which ran back to back: robust to the shared disk's slow swings). "Best raw" is
  the faster of the raw baselines: the disk's own limit as far as this run can tell.
* Where a load's time goes: per rank, the median of unickpt's load phases from its monitoring
  events (``load_phases``: describe, metadata, plan, exchange, read; inside read the readers'
  thread-seconds in read calls, checksums and copies; apply) and the CPU seconds of every cold
  load (unickpt, DCP, raw), all threads of the rank's process: on a shared machine CPU and
  ratios within one run say more than wall times.

Usage:  python bench/save_load.py [--gib 1.0] [--repeats 3] [--world-size 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    EventLog,
    GiB,
    RawBuffer,
    barrier,
    build_model,
    compare_digests,
    dcp_load,
    dcp_save,
    digests,
    dir_bytes,
    evict,
    fmt_gbs,
    fmt_s,
    full_digests,
    gather,
    machine_line,
    make_tmp,
    median,
    model_shape,
    phase_breakdown,
    raw_read,
    raw_read_direct,
    raw_write_buffered,
    raw_write_direct,
    rmtree,
    scramble,
    spawn,
    state_bytes,
    table,
    timed,
    train_step,
    unickpt_bytes_per_rank,
)


def _busy(detail: str) -> float:
    """The thread-seconds a ``load.copy`` / ``load.read.io`` / ``load.checksum`` event reports
    (its detail starts with them)."""
    try:
        return float(detail.split(maxsplit=1)[0])
    except (IndexError, ValueError):
        return float("nan")


def load_phases(events, cpu: float) -> dict[str, float]:
    """Seconds of one unickpt load by phase on this rank, from its events: groups (the
    coordinator: unickpt's process groups, created by the first save or load of a process,
    reused after: ~0), describe (state layout, every rank agrees on what it loads), metadata
    (read + decode), plan (validate + load plan + keys agreed), exchange (the needs sent to the
    coordinator and each rank's part back), read (the read stage, wall), then inside it as
    thread-seconds summed over the reader threads: io (in read calls), crc (verifying
    checksums), copy (copies of what could not land in place); apply (staging copied, optimizer
    state installed), total; cpu: this process's CPU seconds for the whole load (all threads)."""
    by = {}
    for e in events:
        by[e.phase] = e
    out: dict[str, float] = {}
    for key, phase in (("groups", "load.groups"), ("describe", "load.describe"), ("metadata", "load.metadata"),
                       ("plan", "load.plan"), ("exchange", "load.exchange"), ("read", "load.read")):  # fmt: skip
        out[key] = by[phase].seconds if phase in by else 0.0
    for key, phase in (("io", "load.read.io"), ("crc", "load.checksum"), ("copy", "load.copy")):
        out[key] = _busy(by[phase].detail) if phase in by else 0.0
    out["apply"] = by["load.apply"].seconds if "load.apply" in by else 0.0
    out["total"] = by["load.end"].seconds if "load.end" in by else float("nan")
    out["cpu"] = cpu
    return out


def _batch(dim: int, seed: int):
    import torch

    return torch.randn(8, dim, generator=torch.Generator().manual_seed(seed))


def rank_main(rank: int, ws: int, cfg: dict) -> dict:
    """Everything at the saving world size: saves (unickpt, DCP, raw) and same-layout loads."""
    import torch

    import unickpt

    tmp = cfg["tmp"]
    layers, dim = cfg["layers"], cfg["dim"]
    model, optim = build_model(layers, dim, seed=0, fsdp2=True)
    train_step(model, optim, _batch(dim, 1))
    want = digests(model, optim)  # this rank's shards (same-layout loads)
    ref = full_digests(model, optim)  # every full tensor (the resharding loads; collective)
    my_state = state_bytes(model, optim)
    state = {"model": model, "optimizer": optim}
    upath, dpath = os.path.join(tmp, "unickpt"), os.path.join(tmp, "dcp")
    rawdir = os.path.join(tmp, "raw")
    if rank == 0:
        os.makedirs(rawdir, exist_ok=True)
    parts = cfg["files_per_rank"]
    log = EventLog()
    phases: dict[str, list[dict[str, float]]] = {"save": [], "load": []}
    bufs = [RawBuffer(seed=rank * 16 + i) for i in range(parts)]

    def fresh(path: str) -> None:
        if rank == 0:
            rmtree(path)
        barrier()

    # warm-up (first saves: unickpt plans, DCP plans; page cache and allocator warm)
    fresh(upath)
    first_u, _ = timed(lambda: unickpt.save(upath, state, framework="fsdp2"))
    fresh(dpath)
    first_d, _ = timed(lambda: dcp_save(model, optim, dpath))
    per_rank = gather(unickpt_bytes_per_rank(upath) if rank == 0 else None)[0]
    share = per_rank[rank]
    buf_file = os.path.join(rawdir, f"r{rank}-buffered.bin")
    direct_files = [os.path.join(rawdir, f"r{rank}-direct-{i}.bin") for i in range(parts)]

    def raw_buffered() -> None:
        raw_write_buffered(buf_file, share, bufs[0])

    def raw_direct() -> None:
        raw_write_direct(direct_files, share, bufs)

    def unlink(paths: list[str]) -> None:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
        barrier()

    saves = {"unickpt": [], "dcp": [], "raw_buffered": [], "raw_direct": []}
    ops = [
        ("unickpt", lambda: fresh(upath), lambda: unickpt.save(upath, state, framework="fsdp2")),
        ("dcp", lambda: fresh(dpath), lambda: dcp_save(model, optim, dpath)),
        ("raw_buffered", lambda: unlink([buf_file]), raw_buffered),
        ("raw_direct", lambda: unlink(direct_files), raw_direct),
    ]
    for r in range(cfg["repeats"]):
        order = ops[r % len(ops) :] + ops[: r % len(ops)]  # rotate: nobody always goes first
        for name, prepare, op in order:
            prepare()
            log.take()
            saves[name].append(timed(op)[0])
            if name == "unickpt":
                phases["save"].append(phase_breakdown(log.take()))
    unlink([buf_file])

    # cold loads at the same layout
    def cold() -> None:
        if rank == 0:
            evict([upath, dpath, rawdir])
        barrier()

    loads = {"unickpt": [], "unickpt_direct": [], "dcp": [], "raw_read": [], "raw_read_direct": []}
    direct = unickpt.LoadOptions(storage=unickpt.StorageOptions(direct_reads=True))
    cpu = {name: [] for name in loads}  # CPU seconds of this process per load
    rbufs = [RawBuffer(seed=99 + i) for i in range(4)]

    def check(what: str) -> None:
        compare_digests(digests(model, optim), want, what)

    lops = [
        ("unickpt", lambda: unickpt.load(upath, state, framework="fsdp2")),
        ("unickpt_direct", lambda: unickpt.load(upath, state, framework="fsdp2", options=direct)),
        ("dcp", lambda: dcp_load(model, optim, dpath)),
        ("raw_read", lambda: raw_read(direct_files, bufs)),
        ("raw_read_direct", lambda: raw_read_direct(direct_files, rbufs)),
    ]
    for r in range(cfg["repeats"]):
        order = lops[r % len(lops) :] + lops[: r % len(lops)]
        for name, op in order:
            if not name.startswith("raw"):
                scramble(model, optim)
            cold()
            log.take()
            c0 = time.process_time()
            loads[name].append(timed(op)[0])
            cpu[name].append(time.process_time() - c0)
            if name == "unickpt":
                phases["load"].append(load_phases(log.take(), cpu[name][-1]))
            if not name.startswith("raw"):
                check(f"rank {rank}: {name} same-layout load")
    for b in bufs + rbufs:
        b.close()
    loss_check = float(model(_batch(dim, 1)).square().mean().detach())
    out = {
        "saves": saves,
        "loads": loads,
        "cpu": cpu,
        "phases": phases,
        "first": {"unickpt": first_u, "dcp": first_d},
        "per_rank": per_rank,
        "state_bytes": gather(my_state),
        "ubytes": dir_bytes(upath),
        "dbytes": dir_bytes(dpath),
        "raw_bytes": sum(per_rank.values()),
        "loss": loss_check,
    }
    if rank == 0:
        out["ref"] = ref
    torch.distributed.barrier()
    return out


def reshard_main(rank: int, ws: int, cfg: dict, ref: dict) -> dict:
    """One process, no process group: load both checkpoints into a plain model + Adam."""
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

    import unickpt

    tmp = cfg["tmp"]
    upath, dpath = os.path.join(tmp, "unickpt"), os.path.join(tmp, "dcp")
    model, optim = build_model(cfg["layers"], cfg["dim"], seed=1, fsdp2=False)
    train_step(model, optim, _batch(cfg["dim"], 2))  # creates Adam state (different values)
    state = {"model": model, "optimizer": optim}
    times = {"unickpt": [], "dcp": []}

    def check(what: str) -> None:
        compare_digests(digests(model, optim), ref, what)  # one process: its tensors are the full ones

    ops = [
        ("unickpt", lambda: unickpt.load(upath, state, framework="torch")),
        ("dcp", lambda: dcp_load(model, optim, dpath)),
    ]
    log = EventLog()
    phases = []
    for r in range(cfg["repeats"]):
        for name, op in ops if r % 2 == 0 else ops[::-1]:
            scramble(model, optim)
            evict([upath, dpath])
            log.take()
            c0, t0 = time.process_time(), time.perf_counter()
            op()
            times[name].append(time.perf_counter() - t0)
            if name == "unickpt":
                phases.append(load_phases(log.take(), time.process_time() - c0))
            check(f"{name} resharding load")
    return {"times": times, "phases": phases, "loss": float(model(_batch(cfg["dim"], 1)).square().mean().detach())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="total state size (params + Adam), GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2, help="saving world size (FSDP2)")
    ap.add_argument("--dir", default=None, help="parent of the temporary folder (default /tmp)")
    ap.add_argument(
        "--files-per-rank",
        type=int,
        default=2,
        help="unickpt SaveOptions default; also the raw O_DIRECT writer's file count",
    )
    args = ap.parse_args()
    layers, dim = model_shape(args.gib)
    total = layers * dim * dim * 12
    # unickpt + DCP checkpoints + raw files (buffered and direct) at the same time, at most
    tmp = make_tmp(args.dir, 4 * total)
    cfg = {"tmp": tmp, "layers": layers, "dim": dim, "repeats": args.repeats, "files_per_rank": args.files_per_rank}
    ws = args.world_size
    print(
        f"unickpt save/load benchmark: {layers} x Linear({dim}, {dim}) + Adam = "
        f"{total / GiB:.3f} GiB, FSDP2 at world size {ws}, {args.repeats} repeats, folder {tmp}"
    )
    print(machine_line())
    print("writes: fsync'ed (unickpt: its own fsync; DCP: FileSystemWriter sync_files=True)")
    print("reads: cold (page cache evicted)")
    t0 = time.perf_counter()
    try:
        res = spawn(rank_main, ws, cfg)
        r0 = res[0]
        rs = spawn(reshard_main, 0, cfg, r0["ref"])[0]
    finally:
        rmtree(tmp)
    print(f"(ran in {time.perf_counter() - t0:.0f} s; temporary folder removed)\n")
    s, ld, rt = r0["saves"], r0["loads"], rs["times"]
    ub, db, rb = r0["ubytes"], r0["dbytes"], r0["raw_bytes"]

    def row(op: str, xs: list[float], nbytes: int) -> list[str]:
        m = median(xs)
        return [op, fmt_s(m), fmt_s(min(xs)), fmt_s(max(xs)), f"{nbytes / GiB:.3f}", fmt_gbs(nbytes, m)]

    rows = [
        row(f"unickpt save (ws={ws})", s["unickpt"], ub),
        row(f"DCP save (ws={ws})", s["dcp"], db),
        row("raw write buffered+fsync", s["raw_buffered"], rb),
        row(f"raw write O_DIRECT ({args.files_per_rank} files/rank)+fsync", s["raw_direct"], rb),
        row(f"unickpt load (ws={ws}, same layout)", ld["unickpt"], ub),
        row(f"unickpt load, O_DIRECT reads (ws={ws})", ld["unickpt_direct"], ub),
        row(f"DCP load (ws={ws}, same layout)", ld["dcp"], db),
        row("raw cold read buffered (1 thread/file)", ld["raw_read"], rb),
        row("raw cold read O_DIRECT (4 threads/rank)", ld["raw_read_direct"], rb),
        row(f"unickpt reshard load ({ws} -> 1)", rt["unickpt"], ub),
        row(f"DCP reshard load ({ws} -> 1)", rt["dcp"], db),
    ]
    print(
        table(
            f"Times (median of {args.repeats}; GB/s = bytes / median seconds)",
            ["op", "median s", "min s", "max s", "GiB", "GB/s"],
            rows,
        )
    )
    print(
        f"first (warm-up) save, not in the medians: unickpt {r0['first']['unickpt']:.3f} s, "
        f"DCP {r0['first']['dcp']:.3f} s"
    )

    def bw(nbytes: int, xs: list[float]) -> float:
        return nbytes / median(xs)

    def paired(a: list[float], b: list[float]) -> str:
        """median of a / b over the repeats: each pair ran back to back, so slow drifts of the
        shared disk cancel out (the ratio of medians can be skewed by them)"""
        return f"{median([x / y for x, y in zip(a, b)]):.2f}"

    # the device's limit: the best of the raw baselines of this run
    w_raw = min(median(s["raw_buffered"]), median(s["raw_direct"]))
    r_raw = min(median(ld["raw_read"]), median(ld["raw_read_direct"]))
    ratios = [
        [
            "save speedup (DCP s / unickpt s)",
            f"{median(s['dcp']) / median(s['unickpt']):.2f}x",
            paired(s["dcp"], s["unickpt"]),
        ],
        [
            "load speedup (DCP s / unickpt s)",
            f"{median(ld['dcp']) / median(ld['unickpt']):.2f}x",
            paired(ld["dcp"], ld["unickpt"]),
        ],
        [
            "reshard load speedup (DCP s / unickpt s)",
            f"{median(rt['dcp']) / median(rt['unickpt']):.2f}x",
            paired(rt["dcp"], rt["unickpt"]),
        ],
        [
            "unickpt save GB/s / raw buffered write GB/s",
            f"{bw(ub, s['unickpt']) / bw(rb, s['raw_buffered']):.2f}",
            paired([x / rb for x in s["raw_buffered"]], [x / ub for x in s["unickpt"]]),
        ],
        [
            "unickpt save GB/s / raw O_DIRECT write GB/s",
            f"{bw(ub, s['unickpt']) / bw(rb, s['raw_direct']):.2f}",
            paired([x / rb for x in s["raw_direct"]], [x / ub for x in s["unickpt"]]),
        ],
        ["unickpt save GB/s / best raw write GB/s", f"{ub / median(s['unickpt']) / (rb / w_raw):.2f}", ""],
        ["DCP save GB/s / best raw write GB/s", f"{db / median(s['dcp']) / (rb / w_raw):.2f}", ""],
        ["unickpt load GB/s / best raw cold read GB/s", f"{ub / median(ld['unickpt']) / (rb / r_raw):.2f}", ""],
        [
            "unickpt load GB/s / raw buffered cold read GB/s",
            f"{bw(ub, ld['unickpt']) / bw(rb, ld['raw_read']):.2f}",
            paired([x / rb for x in ld["raw_read"]], [x / ub for x in ld["unickpt"]]),
        ],
        [
            "unickpt O_DIRECT load GB/s / best raw cold read GB/s",
            f"{ub / median(ld['unickpt_direct']) / (rb / r_raw):.2f}",
            "",
        ],
        ["DCP load GB/s / best raw cold read GB/s", f"{db / median(ld['dcp']) / (rb / r_raw):.2f}", ""],
        ["unickpt reshard load s / same-layout load s", f"{median(rt['unickpt']) / median(ld['unickpt']):.2f}", ""],
        ["DCP reshard load s / same-layout load s", f"{median(rt['dcp']) / median(ld['dcp']):.2f}", ""],
    ]
    print()
    print(
        table(
            "Ratios (same run): of the medians, and the median of per-repeat pairs",
            ["ratio", "of medians", "paired"],
            ratios,
        )
    )
    per = r0["per_rank"]
    avg = sum(per.values()) / len(per)
    print()
    print(
        table(
            "Bytes written per rank by unickpt (from its metadata) vs the rank's local state",
            ["rank", "unickpt bytes", "GiB", "local state GiB", "/ mean"],
            [
                [r, per[r], f"{per[r] / GiB:.4f}", f"{r0['state_bytes'][r] / GiB:.4f}", f"{per[r] / avg:.3f}"]
                for r in sorted(per)
            ],
        )
    )
    print()
    prow = []
    for rank, r in enumerate(res):
        for kind in ("save", "load"):
            runs = r["phases"][kind]
            keys = list(runs[0]) if runs else []
            prow.append([rank, f"unickpt {kind}", ", ".join(f"{k} {median([x[k] for x in runs]):.3f}" for k in keys)])
    rph = rs["phases"]
    prow.append(
        ["0 (ws 1)", "unickpt reshard load", ", ".join(f"{k} {median([x[k] for x in rph]):.3f}" for k in rph[0])]
    )
    print(
        table(
            "unickpt phases per rank (seconds, median over the timed runs; from its events)",
            ["rank", "op", "phases"],
            prow,
            left=(0, 1, 2),
        )
    )
    kinds = ("unickpt", "unickpt_direct", "dcp", "raw_read", "raw_read_direct")
    cpu_rows = [[rank, *(f"{median(r['cpu'][k]):.3f}" for k in kinds)] for rank, r in enumerate(res)]
    print(
        table(
            "CPU seconds per rank of one cold load (median; all threads of the rank's process)",
            ["rank", "unickpt", "unickpt O_DIRECT", "DCP", "raw buffered", "raw O_DIRECT"],
            cpu_rows,
        )
    )
    print(f"checkpoint sizes on disk: unickpt {ub / GiB:.4f} GiB, DCP {db / GiB:.4f} GiB")
    print("correctness: every same-layout and resharding load restored every tensor bit for bit (SHA-256 of its bytes)")


if __name__ == "__main__":
    main()
