"""Bytes read by a resharding load vs the bytes it needs (the scale issue: "read only what is
needed"), and the time it takes, at FSDP2 world sizes 4 -> 3 and 4 -> 1.

What runs (one invocation): a stack of ``nn.Linear`` layers with Adam state (``--gib`` GiB of
fp32 params + exp_avg + exp_avg_sq), FSDP2 at 4 gloo ranks, saved once by unickpt. Then, per
target world size (3 and 1) and per ``dedup_reads`` setting (auto: ranks of one host read
through the shared page cache; True: each saved byte read by one rank and forwarded), a fresh
FSDP2 job of that size loads the checkpoint cold (page cache evicted) ``--repeats`` times.
Per load: the bytes unickpt read from storage (its ``load.read`` monitoring record, all ranks),
the bytes the ranks need (their local shards of every tensor), the ratio, the bytes forwarded
between ranks (``load.transfer``) and the wall time. Every load is checked bit for bit against
the saved state (SHA-256 of the bytes of every full tensor, ``_common.full_digests``, untimed).

Run: ``python bench/reshard_reads.py [--gib 0.94] [--repeats 2]``; to compare with another tree,
run it with that tree's ``src`` first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    EventLog,
    barrier,
    build_model,
    compare_digests,
    evict,
    full_digests,
    gather,
    machine_line,
    make_tmp,
    median,
    model_shape,
    rmtree,
    spawn,
    table,
    timed,
    train_step,
)


def _needed(model, optim) -> int:
    total = 0
    for p in model.parameters():
        for t in (p, *[v for v in optim.state[p].values() if hasattr(v, "shape")]):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def save_rank(rank: int, ws: int, cfg: dict) -> dict:
    import torch

    import unickpt

    torch.set_num_threads(1)
    layers, dim = cfg["shape"]
    model, optim = build_model(layers, dim, seed=1, fsdp2=True)
    train_step(model, optim, torch.randn(2, dim))
    want = full_digests(model, optim)
    unickpt.save(cfg["path"], {"model": model, "optimizer": optim}, framework="fsdp2").wait()
    return {"digests": want}


def load_rank(rank: int, ws: int, cfg: dict) -> dict:
    import torch

    import unickpt
    from unickpt.options import ReadOptions

    torch.set_num_threads(1)
    layers, dim = cfg["shape"]
    model, optim = build_model(layers, dim, seed=2, fsdp2=True)
    train_step(model, optim, torch.randn(2, dim))  # optimizer state exists, with other values
    log = EventLog()
    options = unickpt.LoadOptions(io=ReadOptions(dedup_reads=cfg["dedup"]))
    rows = []
    for _ in range(cfg["repeats"]):
        barrier()
        if rank == 0:
            evict([cfg["path"]])
        barrier()
        log.take()
        seconds, _ = timed(
            lambda: unickpt.load(cfg["path"], {"model": model, "optimizer": optim}, framework="fsdp2", options=options)
        )
        ev = log.take()
        read = sum(e.nbytes for e in ev if e.phase == "load.read")
        moved = sum(e.nbytes for e in ev if e.phase == "load.transfer")
        rows.append((seconds, read, moved))
        compare_digests(full_digests(model, optim), cfg["want"], f"4 -> {ws}, load {len(rows)}")
    need = _needed(model, optim)
    per_rank = gather((rows, need))
    return {"per_rank": per_rank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=0.94)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--targets", default="3,1")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    shape = model_shape(args.gib)
    tmp = make_tmp(args.dir, int(args.gib * 2 * (1 << 30)))
    path = os.path.join(tmp, "ckpt")
    print(f"resharding reads: FSDP2 ws=4 -> {args.targets}, {shape[0]} x Linear({shape[1]}) + Adam, {args.gib} GiB")
    print(machine_line())
    try:
        want = spawn(save_rank, 4, {"shape": shape, "path": path})[0]["digests"]
        rows = []
        for target in (int(x) for x in args.targets.split(",")):
            for dedup in (None, True):
                if dedup and target == 1:
                    continue  # one rank: nothing to forward
                cfg = {"shape": shape, "path": path, "dedup": dedup, "repeats": args.repeats, "want": want}
                out = spawn(load_rank, target, cfg)[0]
                per_rank = out["per_rank"]
                need = sum(n for _, n in per_rank)
                secs = [max(r[i][0] for r, _ in per_rank) for i in range(args.repeats)]
                read = median([sum(r[i][1] for r, _ in per_rank) for i in range(args.repeats)])
                moved = median([sum(r[i][2] for r, _ in per_rank) for i in range(args.repeats)])
                label = "auto" if dedup is None else "True"
                rows.append(
                    [
                        f"4 -> {target}",
                        label,
                        f"{need / 1e9:.3f}",
                        f"{read / 1e9:.3f}",
                        f"{read / need:.3f}",
                        f"{moved / 1e9:.3f}",
                        f"{median(secs):.3f}",
                    ]
                )
        print(
            table(
                f"bytes read / bytes needed, medians of {args.repeats} cold loads",
                ["load", "dedup_reads", "needed GB", "read GB", "read / needed", "forwarded GB", "seconds"],
                rows,
                left=(0, 1),
            )
        )
    finally:
        rmtree(tmp)


if __name__ == "__main__":
    main()
