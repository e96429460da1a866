"""Rank functions for the S3 checkpoint tests (spawned by ``harness.run_ranks``; the endpoint and
credentials reach them through the standard ``AWS_*`` environment variables)."""

from __future__ import annotations

import torch
from torch import nn

import unickpt
from tests.support.reference import full_state


def tiny(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP + AdamW with one step taken, deterministic in ``seed`` (plain torch)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1000 + seed)
    model(torch.randn(4, 8, generator=g)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def save_replicated(rank: int, ws: int, url: str, seed: int) -> str:
    """Every rank holds the same model (a replicated, DDP-like job): unickpt writes each tensor once."""
    model, optim = tiny(seed)
    h = unickpt.save(url, {"model": model, "optimizer": optim, "extra_state": {"step": 7}}, async_save=True)
    h.wait()
    return h.path


def load_and_compare(rank: int, ws: int, url: str, seed: int) -> list[str]:
    """Load into a differently seeded model; the keys that differ from the seed's own state."""
    want_model, want_optim = tiny(seed)
    want = full_state(want_model, want_optim)
    model, optim = tiny(seed + 1)
    state = {"model": model, "optimizer": optim, "extra_state": {}}
    unickpt.load(url, state)
    got = full_state(model, optim)
    bad = sorted(k for k in set(want) | set(got) if k not in got or k not in want or not torch.equal(got[k], want[k]))
    if state["extra_state"].get("step") != 7:
        bad.append("extra_state.step")
    return bad
