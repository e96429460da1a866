"""Rank functions of tests/integration/integrations/test_lightning_convert_processes.py (issue 39,
items 12 and 13): a tiny LightningModule (``lightning_workers.Tiny``) trained by a real Trainer
with stock Lightning's ``DDPStrategy`` (a ``.ckpt`` file written by rank 0) and with unickpt's
(a unickpt checkpoint written by every rank), then resumed in another world size."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.workers.lightning_workers import Tiny, _fit
from unickpt.errors import NotACheckpointError
from unickpt.integrations.lightning import load_from_checkpoint


def train_both(rank: int, ws: int, root: str) -> dict[str, Any]:
    """One epoch with each backend, a checkpoint at its end (``epoch=0.ckpt``, ``last.ckpt``)."""
    out: dict[str, Any] = {}
    for backend in ("stock", "unickpt"):
        model = _fit("ddp", backend, ws, os.path.join(root, backend), 1, None)
        out[backend] = model.losses
        out[f"weights-{backend}"] = {k: v.tolist() for k, v in model.state_dict().items()}
    return out


def resume_converted(rank: int, ws: int, root: str, converted: str) -> dict[str, Any]:
    """To 2 epochs from stock's ``last.ckpt`` with stock Lightning, and from its conversion with
    unickpt's strategy; the unickpt strategy given the ``.ckpt`` itself (its message); and
    ``load_from_checkpoint`` of the unickpt checkpoint the 2-rank run saved."""
    out: dict[str, Any] = {}
    stock_ckpt = os.path.join(root, "stock", "last.ckpt")
    out["stock"] = _fit("ddp", "stock", ws, os.path.join(root, f"stock-ws{ws}"), 2, stock_ckpt).losses
    resumed = _fit("ddp", "unickpt", ws, os.path.join(root, f"converted-ws{ws}"), 2, converted)
    out["unickpt"] = resumed.losses
    out["loaded_keys"] = resumed.loaded_keys
    try:
        _fit("ddp", "unickpt", ws, os.path.join(root, f"refused-ws{ws}"), 2, stock_ckpt)
        out["file"] = "loaded"
    except NotACheckpointError as e:
        out["file"] = str(e)
    torch.manual_seed(5)  # not the trained weights: they must come from the checkpoint
    module = load_from_checkpoint(Tiny, os.path.join(root, "unickpt", "epoch=0.ckpt"))
    out["load_from_checkpoint"] = {k: v.tolist() for k, v in module.state_dict().items()}
    out["hparams"] = dict(module.hparams)
    return out
