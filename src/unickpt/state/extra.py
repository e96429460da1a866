"""Extra state: RNG states and other per-rank plain values, in the safe value encoding.

``rng_state()`` captures python, numpy, torch CPU (and CUDA, when initialised) generators;
``set_rng_state`` restores them. The engine stores each rank's ``extra_state`` as a checksummed
blob ``extra_state/rank<r>``; on load rank r gets the blob of saved rank ``r % saved_world_size``
(identical to its own when the world size is unchanged).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state", "extra_blob_key", "pick_extra_blob"]


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    if "python" in state:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in state:
        np.random.set_state(tuple(state["numpy"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def extra_blob_key(rank: int, key: str = "extra_state") -> str:
    """The blob of state key ``key``'s per-rank value saved by ``rank`` (``extra_state/rank<r>``)."""
    return f"{key}/rank{rank}"


def pick_extra_blob(blob_keys: set[str], rank: int, saved_world_size: int, key: str = "extra_state") -> str | None:
    """The per-rank blob of ``key`` that ``rank`` restores: its own, else saved rank ``rank % saved``."""
    for r in (rank, rank % max(saved_world_size, 1)):
        blob = extra_blob_key(r, key)
        if blob in blob_keys:
            return blob
    return None
