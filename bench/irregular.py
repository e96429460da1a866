"""Irregular-shard decomposition vs PyTorch's sharded state dict for FSDP1 (CPU, gloo, ws=2).

Spawns 2 ranks (torch.multiprocessing). Each builds a stack of ``--layers`` Linear(in, out)
layers (odd sizes, so the flat shards cut rows) wrapped per layer in FSDP1, runs one training
step (Adam state exists), then measures, interleaved, ``--repeats`` times after one warm-up:
  blocked   unickpt: ``get_framework("fsdp", state).save_view(state)``: the savable items
            exist (zero-copy views, no collective);
            torch:   ``get_state_dict(model, optim, StateDictOptions(full_state_dict=False))``
            (FSDP1 SHARDED_STATE_DICT: all-gathers every flat param and its optimizer state);
  end-to-end unickpt: ``unickpt.save(...).wait()``;
            torch:   ``get_state_dict`` + ``torch.distributed.checkpoint.save``.
Each time is the slowest rank's; the table shows medians. Checkpoints go to a temporary folder
on local disk (``--dir``) and are deleted after every repeat.

    python bench/irregular.py [--layers 4 --in-features 4000 --out-features 4001 --orig]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

from unickpt.testing.launch import run_ranks


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes on the slowest rank (ranks start together)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    del out
    t = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(rank: int, ws: int, args: argparse.Namespace, folder: str) -> dict | None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import unickpt
    from unickpt.frameworks import get_framework

    warnings.filterwarnings("ignore")  # torch's FSDP1 state-dict path deprecation chatter
    # run_ranks (unickpt.testing.launch) has set up the gloo process group
    torch.manual_seed(0)
    layers = [
        nn.Linear(args.in_features if i == 0 else args.out_features, args.out_features) for i in range(args.layers)
    ]
    n_params = sum(p.numel() for layer in layers for p in layer.parameters())
    model = FullyShardedDataParallel(
        nn.Sequential(*layers),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        use_orig_params=args.orig,
        device_id=torch.device("cpu"),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, args.in_features)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    state = {"model": model, "optimizer": optim}
    opts = StateDictOptions(full_state_dict=False)

    def u_blocked() -> Any:
        return get_framework("fsdp", state).save_view(state)

    def t_blocked() -> Any:
        return get_state_dict(model, optim, options=opts)

    def u_save(path: str) -> Any:
        return unickpt.save(path, state, framework="fsdp").wait()

    def t_save(path: str) -> Any:
        msd, osd = get_state_dict(model, optim, options=opts)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    times: dict[str, list[float]] = {k: [] for k in ("u_blocked", "t_blocked", "u_save", "t_save")}
    for rep in range(1 + args.repeats):
        order = ("u", "t") if rep % 2 == 0 else ("t", "u")
        sample = {}
        for who in order:
            sample[f"{who}_blocked"] = _timed(u_blocked if who == "u" else t_blocked)
            path = os.path.join(folder, f"{who}{rep}")
            sample[f"{who}_save"] = _timed(lambda who=who, path=path: (u_save if who == "u" else t_save)(path))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        if rep > 0:  # the first round is a warm-up (plan caches, page allocation)
            for k, v in sample.items():
                times[k].append(v)
    return {"times": times, "params": n_params} if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--in-features", type=int, default=4000)
    ap.add_argument("--out-features", type=int, default=4001)
    ap.add_argument("--orig", action="store_true", help="use_orig_params=True")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent folder for the temporary checkpoints")
    args = ap.parse_args()

    ws = 2
    folder = tempfile.mkdtemp(prefix="unickpt-bench-irregular-", dir=args.dir)
    try:
        res = run_ranks(_worker, ws, args, folder, timeout=900, threads=1)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in res["times"].items()}
    gib = res["params"] * 4 * 3 / 2**30  # fp32 params + Adam exp_avg + exp_avg_sq
    print(
        f"FSDP1 ws={ws} use_orig_params={args.orig}: {args.layers} x Linear({args.in_features}, "
        f"{args.out_features}), {res['params'] / 1e6:.1f} M params, params+Adam {gib:.2f} GiB; "
        f"median of {args.repeats} (slowest rank)"
    )
    print(f"{'':28s}{'unickpt':>12s}{'torch':>12s}{'ratio':>10s}")
    for label, u, t in (
        ("blocked (shards ready) [s]", "u_blocked", "t_blocked"),
        ("end-to-end save [s]", "u_save", "t_save"),
    ):
        print(f"{label:28s}{med[u]:12.4f}{med[t]:12.4f}{med[t] / med[u]:9.1f}x")
    for k, v in res["times"].items():
        print(f"  {k}: {', '.join(f'{x:.4f}' for x in v)}")


if __name__ == "__main__":
    main()
