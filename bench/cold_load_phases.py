"""Where a cold unickpt load's time goes, A/B between source trees (issue #30 item 1).

One checkpoint (FSDP2 ws=2, ``--layers`` x Linear(dim, dim) + bias + AdamW: 21 layers = 1 GiB) is
saved once with the first tree; then, for each round and each tree in turn (interleaved), fresh
rank processes load it ``--loads`` times (the files evicted from the page cache before each
load): ``same`` (ws=2, the saved layout) and/or ``reshard`` (ws=1, 2 -> 1). Every load is
checked bit for bit (CRC32C of each local tensor against the saved values). Printed per tree
and rank, for each process's first load (a job's start-up) and its later ones: medians of
unickpt's load phases from its events (``save_load.load_phases``: groups (process-group
creation: the whole cost in a process's first load), describe, metadata, plan, exchange,
read wall; inside read the thread-seconds in read calls (io), in checksums (crc), in copies),
the load's wall time and the process's CPU seconds; ``import``: the seconds of ``import unickpt``
(with ``--imports all``, the default, plus every module a load imports, so that the first load
pays none; ``--imports unickpt``: only what a job imports, so the first load pays what
``import unickpt`` defers), in the process's first load's row.

    python bench/cold_load_phases.py --src /work/main/src --src src --rounds 3

Evicts only the checkpoint's own files (``posix_fadvise(DONTNEED)``), never the whole cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HERE = os.path.dirname(os.path.abspath(__file__))


def _crcs(tensors: dict) -> dict[str, int]:
    import crc32c
    import torch

    return {
        k: crc32c.crc32c(memoryview(v.detach().contiguous().view(-1).view(torch.uint8).numpy()))
        for k, v in tensors.items()
    }


def rank_main(cfg: dict, rank: int, ws: int) -> None:
    """One rank: ``setup`` saves and records the CRCs; ``same`` / ``reshard`` time the loads."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=ws)
    from torch.distributed.fsdp import fully_shard  # noqa: F401  # as an FSDP2 job has, before unickpt

    t_import = time.perf_counter()
    import unickpt

    if cfg["imports"] == "all":  # what a load imports, imported outside the timers
        import unickpt.api
        import unickpt.engine.load.pipeline
        import unickpt.frameworks.registry
    t_import = time.perf_counter() - t_import
    from _common import EventLog, evict, local_tensors, scramble
    from _three_way_ranks import build_big, train_step
    from save_load import load_phases

    ckpt, mode = cfg["ckpt"], cfg["mode"]
    model, optim = build_big(cfg["layers"], cfg["dim"], 1 if mode == "setup" else 7)
    train_step(model, optim, torch.randn(8, cfg["dim"]))
    state = {"model": model, "optimizer": optim}
    if mode == "setup":
        unickpt.save(ckpt, state, framework="fsdp2")
        full = {k: v.full_tensor() for k, v in local_tensors_dt(model, optim).items()}
        with open(f"{ckpt}.crc.{rank}.json", "w") as f:
            json.dump({"local": _crcs(local_tensors(model, optim)), "full": _crcs(full)}, f)
        dist.barrier()
        return
    with open(f"{ckpt}.crc.{rank}.json") as f:
        want = json.load(f)["local" if mode == "same" else "full"]
    # the event listener lives on the default checkpointer, whose module imports the whole load
    # path: with --imports unickpt the first load runs without it (its phases read 0, total nan)
    log = EventLog() if cfg["imports"] == "all" else None
    runs = []
    for _ in range(cfg["loads"]):
        scramble(model, optim)
        dist.barrier()
        if rank == 0:
            evict([ckpt])
        dist.barrier()
        if log is not None:
            log.take()
        c0, t0 = time.process_time(), time.perf_counter()
        unickpt.load(ckpt, state, framework="fsdp2")
        dist.barrier()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        phases = load_phases(log.take() if log is not None else [], cpu)
        log = log if log is not None else EventLog()
        phases["wall"] = wall
        phases["import"] = t_import if not runs else 0.0  # ``import unickpt`` (+ the pre-imports), once
        got = _crcs(local_tensors(model, optim))
        bad = [k for k in want if got.get(k) != want[k]]
        if bad:
            raise AssertionError(f"rank {rank}: {len(bad)} tensor(s) differ after the load, e.g. {bad[:3]}")
        runs.append(phases)
    with open(f"{cfg['out']}.{rank}", "w") as f:
        json.dump(runs, f)
    dist.destroy_process_group()


def local_tensors_dt(model, optim) -> dict:
    """Every DTensor parameter / optimizer state (for the full tensors the 2 -> 1 load must give)."""
    out, names = {}, {}
    for n, p in model.named_parameters():
        out["model." + n] = p
        names[id(p)] = n
    for p, st in optim.state.items():
        for k, v in st.items():
            if hasattr(v, "full_tensor"):
                out[f"optim.{names[id(p)]}.{k}"] = v
    return out


def spawn(src: str, cfg: dict, ws: int, timeout: float) -> list[list[dict]]:
    from _common import free_port

    env = {
        **os.environ,
        "PYTHONPATH": os.path.abspath(src),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    arg = json.dumps(cfg)
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(ws), arg], env=env) for r in range(ws)]
    for p in procs:
        if p.wait(timeout) != 0:
            raise SystemExit(f"a rank of {cfg['mode']} with {src} failed (exit {p.returncode})")
    if cfg["mode"] == "setup":
        return []
    out = []
    for r in range(ws):
        with open(f"{cfg['out']}.{r}") as f:
            out.append(json.load(f))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", action="append", required=True, help="a unickpt source tree (repeat for A/B)")
    ap.add_argument("--modes", default="same,reshard")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per tree and mode (interleaved)")
    ap.add_argument("--loads", type=int, default=3, help="cold loads per process")
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--dir", default=None)
    ap.add_argument(
        "--imports",
        choices=("all", "unickpt"),
        default="all",
        help="before the clock: every module a load imports (all), or only `import unickpt` as a job does "
        "(unickpt: the first load pays what it defers); the time of these imports is the column 'import'",
    )
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="unickpt-coldload-", dir=args.dir)
    base = {
        "ckpt": os.path.join(tmp, "ckpt"),
        "layers": args.layers,
        "dim": args.dim,
        "loads": args.loads,
        "imports": args.imports,
    }
    spawn(args.src[0], {**base, "mode": "setup", "out": ""}, 2, args.timeout)
    got: dict[tuple[str, str], list[list[dict]]] = {}
    for rnd in range(args.rounds):
        for mode in args.modes.split(","):
            for src in args.src:
                print(f"[{time.strftime('%H:%M:%S')}] round {rnd + 1}/{args.rounds}: {mode} {src}", flush=True)
                ranks = spawn(
                    src,
                    {**base, "mode": mode, "out": os.path.join(tmp, "out")},
                    2 if mode == "same" else 1,
                    args.timeout,
                )
                for r, runs in enumerate(ranks):
                    got.setdefault((mode, src), [[] for _ in ranks])[r].extend(runs)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; medians, seconds")
    for (mode, src), ranks in got.items():
        for r, runs in enumerate(ranks):
            keys = list(runs[0])
            later = [x for i, x in enumerate(runs) if i % args.loads]
            for label, part in (("first", runs[:: args.loads]), ("later", later)):
                if not part:
                    continue
                med = "  ".join(f"{k}={statistics.median(x[k] for x in part):.3f}" for k in keys)
                print(f"{mode:8s} {src:30s} rank {r} {label}: {med}  (n={len(part)})")
    subprocess.run(["rm", "-rf", tmp], check=False)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(json.loads(sys.argv[4]), int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
