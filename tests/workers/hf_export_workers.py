"""Rank function of the in-save Hugging Face export test (issue 30 item 4): one spawn, ws=2.

1. a tiny Llama (``hf_workers.llama``) sharded with FSDP2, saved with
   ``SaveOptions(hf_export=HFExport(dtype="bf16", max_shard_bytes=..., config=...))``;
2. a two-layer MLP with tensor parallelism (``ColwiseParallel`` up: dim-0 boxes;
   ``RowwiseParallel`` down: dim-1 boxes, one run per row, a replicated bias), saved with an
   fp32 export and a ``key_map`` rename;
3. ``unickpt.export_hf`` into a folder that is not empty: refused on every rank.
Rank 0 then runs the offline ``unickpt merge`` of both checkpoints with the same settings.
Expected values: each parameter's ``full_tensor()`` (torch's own gather), cast by torch."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import unickpt
from tests.workers.hf_workers import _fsdp2, llama, llama_config

SHARD_BYTES = 6_000


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


def _mlp() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(11)
    mlp = nn.Sequential()
    mlp.add_module("up", nn.Linear(8, 12))
    mlp.add_module("down", nn.Linear(12, 6))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _renamed(name: str) -> str | None:
    return None if name == "up.bias" else f"mlp.{name}"


def export_ws2(rank: int, ws: int, root: str) -> dict[str, Any]:
    from unickpt.ops.merge import merge

    cfg_dir = os.path.join(root, "config")
    if rank == 0:
        llama_config().save_pretrained(cfg_dir)
    dist.barrier()
    config = os.path.join(cfg_dir, "config.json")

    model = _fsdp2(llama(5))
    opts = unickpt.HFExport(dtype="bf16", max_shard_bytes=SHARD_BYTES, config=config)
    unickpt.save(os.path.join(root, "llama"), {"model": model}, options=unickpt.SaveOptions(hf_export=opts))
    llama_full = {k: _full(v).detach().to(torch.bfloat16) for k, v in model.state_dict().items()}

    mlp = _mlp()
    tp = unickpt.HFExport(max_shard_bytes=200, key_map=_renamed)
    unickpt.save(os.path.join(root, "mlp"), {"model": mlp}, options=unickpt.SaveOptions(hf_export=tp))
    mlp_full = {k: _full(v).detach().clone() for k, v in mlp.state_dict().items()}
    placements = {k: [type(p).__name__ for p in v.placements] for k, v in mlp.state_dict().items()}

    busy = os.path.join(root, "busy")
    if rank == 0:
        os.makedirs(busy)
        with open(os.path.join(busy, "mine.txt"), "w") as f:
            f.write("the user's")
    refused = ""
    try:
        unickpt.export_hf(busy, {"model": mlp})
    except unickpt.CheckpointError as e:
        refused = f"{type(e).__name__}: {e}"

    if rank == 0:
        merge(
            os.path.join(root, "llama"),
            os.path.join(root, "llama_merged"),
            model_only=True,
            dtype="bf16",
            max_shard_bytes=SHARD_BYTES,
            hf_config=config,
        )
        merge(
            os.path.join(root, "mlp"),
            os.path.join(root, "mlp_merged"),
            model_only=True,
            max_shard_bytes=200,
            key_map=_renamed,
        )
    dist.barrier()
    return {"llama": llama_full, "mlp": mlp_full, "placements": placements, "refused": refused}
