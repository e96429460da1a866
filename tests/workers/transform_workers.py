"""Rank functions for the load-time transform tests (``tests/integration/tools/test_tools_transforms.py``): a model
with a fused QKV projection, saved; a model with separate Q, K, V, loaded through
``LoadOptions(restore=RestoreOptions(transforms=...))``. Plain torch modules, FSDP2-sharded when ``ws > 1``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import unickpt
from tests.support.reference import full_state
from unickpt.format.transforms import split_rows
from unickpt.options import RestoreOptions

D, H = 8, 12  # model width, rows of each of Q, K, V


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * H)
        self.out = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(H, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


class Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(D, H)
        self.out = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.out(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


class QOnly(nn.Module):
    """Only the query projection of ``Split`` (a model that needs Q and not K, V)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.q(x))


def qkv_transforms(names: str = "qkv") -> list:
    """Q, K, V (or those of ``names``) from the fused ``qkv`` weight and bias."""
    out = []
    for p in ("weight", "bias"):
        out += [
            t
            for t in split_rows(f"model.qkv.{p}", [(f"model.{n}.{p}", H) for n in "qkv"])
            if t.key.split(".")[1] in names
        ]
    return out


def built(cls: type[nn.Module], seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``cls`` at ``seed``, FSDP2-sharded over the process group when there is one, AdamW with
    one step taken (so there is optimizer state)."""
    torch.manual_seed(seed)
    model = cls()
    if dist.is_initialized() and dist.get_world_size() > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    g = torch.Generator().manual_seed(100 + seed)
    model(torch.randn(2, 5, D, generator=g)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def save_fused(rank: int, ws: int, ckpt: str) -> dict | None:
    model, optim = built(Fused, 0)
    unickpt.save(ckpt, {"model": model, "optimizer": optim})
    state = full_state(model, optim)
    return {k: v.tolist() for k, v in state.items()} if rank == 0 else None


def load_split(rank: int, ws: int, ckpt: str) -> dict:
    model, optim = built(Split, 1)
    unickpt.load(
        ckpt,
        {"model": model, "optimizer": optim},
        options=unickpt.LoadOptions(restore=RestoreOptions(transforms=qkv_transforms())),
    )
    state = full_state(model, optim)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
    return {"state": {k: v.tolist() for k, v in state.items()}, "groups": groups}
