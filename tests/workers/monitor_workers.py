"""Rank functions of the monitoring tests."""

from __future__ import annotations

import time

import torch
from torch import nn

import unickpt
from unickpt.monitoring import JsonlSink


def save_and_load_recorded(rank: int, ws: int, path: str, folder: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optim.step()
    sink = JsonlSink(folder)
    sink.set_context(step=42, role="actor")
    ckpt = unickpt.default_checkpointer()
    ckpt.events.add_listener(sink)
    t0 = time.perf_counter()
    unickpt.save(path, {"model": model, "optimizer": optim})
    t_save = time.perf_counter() - t0
    t1 = time.perf_counter()
    unickpt.load(path, {"model": model, "optimizer": optim})
    t_load = time.perf_counter() - t1
    ckpt.events.remove_listener(sink)
    sink.close()
    return {"save": t_save, "load": t_load}


def save_with_and_without_phases(rank: int, ws: int, base: str) -> None:
    """Two saves of a small model by every rank: ``base/on`` with the default options (phase
    records kept), ``base/off`` with ``record_phases=False``."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    unickpt.save(f"{base}/on", {"model": model}, framework="ddp")
    unickpt.save(f"{base}/off", {"model": model}, framework="ddp", options=unickpt.SaveOptions(record_phases=False))
