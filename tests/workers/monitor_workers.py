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


def save_with_and_without_phases(rank: int, ws: int, base: str) -> list[tuple[str, float, float]]:
    """Two saves of a small model by every rank: ``base/on`` with the default options (phase
    records kept), ``base/off`` with ``record_phases=False``; then a load of ``base/on`` by a
    fresh checkpointer (its first call: it creates its process groups). Returns that load's
    events: (phase, t_start, t_end), in the order its listener got them."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    unickpt.save(f"{base}/on", {"model": model}, framework="ddp")
    unickpt.save(f"{base}/off", {"model": model}, framework="ddp", options=unickpt.SaveOptions(record_phases=False))
    got: list[tuple[str, float, float]] = []
    fresh = unickpt.Checkpointer(listeners=[lambda e: got.append((e.phase, e.t_start, e.t_end))])
    try:
        fresh.load(f"{base}/on", {"model": model}, framework="ddp")
    finally:
        fresh.close()
    return got
