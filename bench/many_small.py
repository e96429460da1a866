"""Many small tensors: a 20,000-tensor FSDP2 state of ~193 MB at world size 2, unickpt vs DCP.

The model is ``--params`` small parameters (each ``--rows`` x 50 fp32) in groups of 100 per
``fully_shard`` unit, trained one AdamW step: parameters + ``exp_avg`` + ``exp_avg_sq`` (+ a 0-d
``step`` per parameter) are ~20,000 tensors. Per round, interleaved, each library in two fresh
rank processes of its own (run in one process, what one library leaves in the heap slowed the
other: unickpt's load took 0.08-0.1 s longer right after a DCP save): unickpt save (the first
save of a fresh Checkpointer, then a second one with the cached plan) and load (first load, cold
page cache); then DCP save and load (``get_state_dict`` + ``dcp.save`` / ``dcp.load`` +
``set_state_dict``), cold page cache too. Every load is checked bit for bit against the saved
tensors (``torch.equal`` on the bytes of every local tensor, untimed).
Prints medians, the per-tensor cost and the DCP/unickpt ratio.

    python bench/many_small.py [--params 6700] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    build_many_small,
    byte_mismatches,
    dcp_load,
    dcp_save,
    evict,
    fmt_s,
    local_tensors,
    machine_line,
    make_tmp,
    median,
    rmtree,
    spawn,
    table,
    timed,
)


def _build(params: int, rows: int, seed: int):
    return build_many_small(params, rows, seed)


def rank_main(rank: int, ws: int, cfg: dict) -> dict:
    """One round of one library (``cfg["lib"]``) in processes of its own: unickpt's first
    save (a fresh Checkpointer), its cached save and its first load (cold page cache), or
    DCP's save and load; the load checked bit for bit against the saved tensors."""
    import torch
    import torch.distributed as dist

    import unickpt

    torch.set_num_threads(1)
    model, optim = _build(cfg["params"], cfg["rows"], seed=1)
    fresh_model, fresh_optim = _build(cfg["params"], cfg["rows"], seed=2)
    tensors = sum(1 for _ in model.parameters()) + sum(len(s) for s in optim.state.values())
    times: dict[str, float] = {}
    base = os.path.join(cfg["tmp"], f"r{cfg['round']}")
    state = {"model": model, "optimizer": optim}
    if cfg["lib"] == "unickpt":
        with unickpt.Checkpointer() as ck:  # a fresh one: no cached plan
            times["first save"], _ = timed(lambda: ck.save(base + "-u", state).wait())
            times["cached save"], _ = timed(lambda: ck.save(base + "-u2", state).wait())
        written = [base + "-u", base + "-u2"]
    else:
        times["dcp save"], _ = timed(lambda: dcp_save(model, optim, base + "-d"))
        written = [base + "-d"]
    dist.barrier()
    if rank == 0:
        evict(written)
    dist.barrier()
    if cfg["lib"] == "unickpt":
        with unickpt.Checkpointer() as ck:
            into = {"model": fresh_model, "optimizer": fresh_optim}
            times["first load"], _ = timed(lambda: ck.load(base + "-u", into))
    else:
        times["dcp load"], _ = timed(lambda: dcp_load(fresh_model, fresh_optim, base + "-d"))
    bad = byte_mismatches(local_tensors(fresh_model, fresh_optim), local_tensors(model, optim))
    if bad:  # the saved model is untouched since its save: compared byte for byte with what was loaded
        raise AssertionError(f"rank {rank}: {cfg['lib']} load differs from the saved state in {len(bad)}: {bad[:3]}")
    dist.barrier()
    if rank == 0:
        for path in written:
            rmtree(path)
    dist.barrier()
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return {"times": times, "tensors": tensors, "bytes": nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=6700, help="parameters (x3 with AdamW state: tensors)")
    ap.add_argument("--rows", type=int, default=48, help="rows of each (rows x 50) fp32 parameter")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    nbytes = args.params * args.rows * 50 * 4 * 3
    tmp = make_tmp(args.dir, 4 * nbytes)
    print(f"many small tensors: {args.params} params ({args.rows}x50 fp32) + AdamW, FSDP2 ws=2, {nbytes / 1e6:.0f} MB")
    print(machine_line())
    t: dict[str, list[float]] = {k: [] for k in ("first save", "cached save", "first load", "dcp save", "dcp load")}
    try:
        for r in range(args.rounds):  # each library in fresh processes, interleaved round by round
            for lib in ("unickpt", "dcp"):
                cfg = {"tmp": tmp, "params": args.params, "rows": args.rows, "round": r, "lib": lib}
                r0 = spawn(rank_main, 2, cfg)[0]
                for op, seconds in r0["times"].items():
                    t[op].append(seconds)
    finally:
        rmtree(tmp)
    n = r0["tensors"]  # keys: every rank holds a shard of each
    rows = []
    for op, dcp_op in (("first save", "dcp save"), ("cached save", "dcp save"), ("first load", "dcp load")):
        m, d = median(t[op]), median(t[dcp_op])
        rows.append([f"unickpt {op}", fmt_s(m), f"{m / n * 1e6:.0f} us", fmt_s(d), f"{d / m:.2f}x"])
    print(
        table(
            f"{n} tensors, {r0['bytes'] / 1e6:.0f} MB, medians of {args.rounds}",
            ["op", "unickpt", "per tensor", "DCP", "DCP / unickpt"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
