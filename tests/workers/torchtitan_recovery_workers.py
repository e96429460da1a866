"""Rank functions of tests/integration/integrations/test_torchtitan_recovery_processes.py:
``UnickptCheckpointManager`` with the RAM tier on (``unickpt_fast_root``), each rank a simulated
host (``recovery_workers.enter_host``: ``UNICKPT_HOST_ID`` and a private ``UNICKPT_SHM_ROOT``),
driven in torchtitan's trainer order (``torchtitan_workers``)."""

from __future__ import annotations

import os
from typing import Any

from tests.workers.recovery_workers import enter_host
from tests.workers.torchtitan_workers import build, snapshot, train_step

TIER = {"unickpt_fast_root": "shm://titan", "unickpt_replicas": 1, "unickpt_durable_every": 2}


def save_three_steps(rank: int, ws: int, root: str, hosts: list[str]) -> dict[str, Any]:
    """Async saves at steps 1, 2, 3 (interval 1) through the tier; the state at step 3 and the
    next batch; rank 0 also the checkpoint folder's entries after ``close``."""
    del ws
    enter_host(root, hosts[rank])
    t = build(root, interval=1, keep_latest_k=0, async_mode="async", **TIER)
    out: dict[str, Any] = {"fresh_load": t["manager"].load()}
    for _ in range(3):
        train_step(t)
    out["saved"] = snapshot(t)
    out["next_batch"] = next(t["data"]).clone()
    t["manager"].close()
    out["folders"] = sorted(os.listdir(os.path.join(root, "checkpoint"))) if rank == 0 else []
    return out


def resume(rank: int, ws: int, root: str, hosts: list[str], config: dict[str, Any] | None = None) -> dict[str, Any]:
    """A restarted job: fresh objects (``config``: more config fields), ``load()`` (the tier's
    ``load_latest``), the state and next batch."""
    del ws
    enter_host(root, hosts[rank])
    t = build(root, interval=1, keep_latest_k=0, async_mode="async", **TIER, **(config or {}))
    loaded = t["manager"].load()
    report = t["manager"]._tiers.last_recovery
    t["data"] = iter(t["dataloader"])  # the trainer makes its data iterator after the load
    out = {"loaded": loaded, "resumed": snapshot(t), "next_batch": next(t["data"]).clone(),
           "tier": report.tier, "step": report.step, "bytes": dict(report.bytes_by_source)}  # fmt: skip
    t["manager"].close()
    return out
