"""Rank functions for the Megatron tests (spawned by ``harness.run_ranks``: importable
module-level functions). Results travel in unickpt's safe value encoding (plain values, tensors,
nested dicts), so rank 0 returns the gathered full states and the other ranks only small values."""

from __future__ import annotations

import time
from typing import Any

from tests.workers import megatron_env as env

SEED = 1234


def layout_run(
    rank: int,
    world: int,
    tp: int,
    pp: int,
    dp: int,
    dist_opt: bool,
    virtual_pp: int | None = None,
    check_sharded: bool = False,
    bf16: bool = False,
) -> dict[str, Any]:
    """Build at one layout, gather the initial full model, run one train step, gather the full
    model and optimizer state after it (``check_sharded``: and check megatron's sharded_state_dict
    descriptions against them), then load the initial model back (``load_full_model_state``)
    and gather it again. Every rank returns its loss; rank 0 also the states."""
    t0 = time.perf_counter()
    chunks, opt = env.build_gpt(
        tp, pp, dp, seed=SEED, use_distributed_optimizer=dist_opt, virtual_pp=virtual_pp, bf16=bf16
    )
    t1 = time.perf_counter()
    initial = env.full_model_state(chunks)
    t2 = time.perf_counter()
    loss = env.train_step(chunks, opt, 0)
    t3 = time.perf_counter()
    # after the step: the torch optimizer's state exists only once it has stepped
    sharded = env.sharded_state_dict_report(chunks, opt if dist_opt else None) if check_sharded else None
    model = env.full_model_state(chunks)
    optim = env.full_optimizer_state(chunks, opt)
    env.load_full_model_state(chunks, initial, opt)
    reloaded = env.full_model_state(chunks)
    reloaded_main = {n: s["main_param"] for n, s in env.full_optimizer_state(chunks, opt).items()}
    out: dict[str, Any] = {
        "loss": loss,
        "inner_optimizers": [type(o).__name__ for o in opt.chained_optimizers],
        "seconds": {"build": t1 - t0, "train_step": t3 - t2},
    }
    if rank == 0:
        import torch

        out.update(initial=initial, model=model, optim=optim, sharded=sharded)
        out.update(reloaded=reloaded, reloaded_main=reloaded_main)
        out["patches"] = [p.name for p in env.PATCHES]
        out["cuda_current_device"] = str(torch.cuda.current_device())
    return out
