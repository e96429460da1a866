"""Rank functions of the resize-warning tests (issue 39 item 19), spawned by ``harness.run_ranks``."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import unickpt


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def save_alike_and_per_rank(rank: int, ws: int, alike: str, differ: str) -> None:
    """``alike``: extra_state every rank saves the same (a step, no RNG); ``differ``: a step the
    same on every rank and each rank's own RNG state."""
    unickpt.save(alike, {"model": _model(), "extra_state": {"step": 100}})
    torch.manual_seed(1000 + rank)
    unickpt.save(differ, {"model": _model(), "extra_state": {"step": 100, "rng": unickpt.rng_state()}})


def load_warnings(rank: int, ws: int, path: str) -> dict:
    """Load ``path`` (default options: extra_state_on_resize='modulo'); this rank's warnings and
    the restored step."""
    state = {"model": _model(), "extra_state": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unickpt.load(path, state)
    return {"step": state["extra_state"]["step"], "warnings": [str(w.message) for w in caught]}
