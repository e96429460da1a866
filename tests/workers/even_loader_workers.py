"""Rank functions of the equal-batches tests (issue 39 item 24), spawned by ``harness.run_ranks``:
a training-like loop over a ``TokenPackingLoader(epochs=1)``, one all_reduce per batch as a
data-parallel step does."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import unickpt
from tests.workers.loader_data import PAD, make_loader


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def train_to_end(rank: int, ws: int, sources, path: str, resume: bool, stop_after: int | None) -> dict:
    """Iterate the loader (equal batches, the default) with an all_reduce per batch; ``resume``:
    load ``path`` first; ``stop_after``: save ``path`` after that many batches and stop."""
    loader = make_loader(sources, rank, ws, num_workers=1, even_batches=True)
    model = _model()
    if resume:
        unickpt.load(path, {"model": model, "dataloader": loader})
    steps, rows, tokens = 0, [], []
    for batch in loader:
        grad = torch.ones(1)
        dist.all_reduce(grad)  # the step's collective: every rank must be here for every batch
        assert int(grad.item()) == ws
        steps += 1
        rows.append(int(batch.shape[0]))
        tokens += [int(t) for t in batch.reshape(-1) if int(t) != PAD]
        if stop_after is not None and steps == stop_after:
            unickpt.save(path, {"model": model, "dataloader": loader})
            break
    loader.close()
    return {"steps": steps, "rows": rows, "tokens": tokens}
