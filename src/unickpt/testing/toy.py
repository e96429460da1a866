"""A small causal transformer and builders that parallelise it for each framework.

Used by the demo (``examples/demo.py``), the benchmarks and the multi-rank tests to build and
train models; never as a test's oracle (reference states come from ``tests/support/reference.py``, written with
torch's own APIs). Sizes are deliberately uneven
(odd vocabulary, hidden sizes not divisible by 3) so that every resharding exercises uneven
shards. ``build(framework, ...)`` returns ``(model, optimizer)``; every rank trains on the same
global batch (``batch(step)``), so the loss is a function of the parameters alone and
trajectories can be compared bit for bit across world sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ToyConfig", "ToyTransformer", "build", "batch", "train_step"]


@dataclass(frozen=True)
class ToyConfig:
    vocab: int = 203
    dim: int = 36
    heads: int = 4
    layers: int = 2
    ffn: int = 100
    seq: int = 16
    batch: int = 4


class Block(nn.Module):
    def __init__(self, c: ToyConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.dim)
        self.q = nn.Linear(c.dim, c.dim, bias=False)
        self.k = nn.Linear(c.dim, c.dim, bias=False)
        self.v = nn.Linear(c.dim, c.dim, bias=False)
        self.o = nn.Linear(c.dim, c.dim, bias=False)
        self.norm2 = nn.LayerNorm(c.dim)
        self.fc1 = nn.Linear(c.dim, c.ffn)
        self.fc2 = nn.Linear(c.ffn, c.dim)
        self.head_dim = c.dim // c.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ToyTransformer(nn.Module):
    def __init__(self, c: ToyConfig = ToyConfig()) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def batch(step: int, c: ToyConfig = ToyConfig()) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=g)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, c: ToyConfig = ToyConfig()) -> float:
    tokens = batch(step, c)
    logits = model(tokens[:, :-1])
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    loss = F.cross_entropy(logits.reshape(-1, c.vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def _tp_plan() -> dict[str, ParallelStyle]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "o": RowwiseParallel(),
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
    }


def build(
    framework: str,
    c: ToyConfig = ToyConfig(),
    seed: int = 0,
    lr: float = 1e-2,
    tp: int = 2,
    *,
    use_orig_params: bool = False,
    sharding: str = "FULL_SHARD",
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Build the toy model for ``framework`` on the current process group (or one process).

    ``use_orig_params`` and ``sharding`` (a ``ShardingStrategy`` name) apply to ``"fsdp"``
    (FSDP1, every Block wrapped, then the root)."""
    torch.manual_seed(seed)
    toy = ToyTransformer(c)
    model: nn.Module = toy
    ws = dist.get_world_size() if dist.is_initialized() else 1
    if framework == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for blk in toy.blocks:
            fully_shard(blk)
        fully_shard(model)
    elif framework == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
        for blk in toy.blocks:
            parallelize_module(blk, mesh, _tp_plan())
    elif framework == "fsdp2+tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (ws // tp, tp), mesh_dim_names=("dp", "tp"))
        for blk in toy.blocks:
            parallelize_module(blk, mesh["tp"], _tp_plan())
            fully_shard(blk, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif framework == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy[sharding],
            use_orig_params=use_orig_params,
            device_id=next(model.parameters()).device,
        )
    elif framework != "torch":
        raise ValueError(f"unknown toy framework {framework!r}")
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    return model, optim
