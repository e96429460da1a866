"""Rank functions of the DCP export tests (spawned by ``harness.run_ranks``)."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torchtitan.components.dataloader import ParallelAwareDataloader

import unickpt


def save_titan_loaders(rank: int, ws: int, path: str) -> list[int]:
    """Each DP rank's torchtitan loader consumes ``1 + rank`` batches, then the job saves model +
    loader as the torchtitan integration does (per-rank loader state); returns the batch this
    rank's loader gives next."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's set_vital deprecation
        loader = ParallelAwareDataloader(list(range(64)), dp_rank=rank, dp_world_size=ws, batch_size=4)
        batches = iter(loader)
        for _ in range(1 + rank):
            next(batches)
        torch.manual_seed(0)
        unickpt.save(path, {"model": nn.Linear(4, 2), "dataloader": loader})
        return [int(x) for x in next(batches)]
