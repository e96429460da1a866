"""Rank functions of the one-rank save test (issue 39 item 25), spawned by ``harness.run_ranks``."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import unickpt


def save_on_rank0_only(rank: int, ws: int, path: str, timeout: float) -> dict:
    """Rank 0 calls ``unickpt.save`` with ``SaveOptions(timeout=...)``, the others do not (the
    ``if rank == 0: torch.save(...)`` habit) and wait in the job's next collective (a barrier),
    which rank 0 reaches once its save gave up."""
    if rank != 0:
        dist.barrier()
        return {}
    t0 = time.monotonic()
    try:
        unickpt.save(path, {"model": torch.nn.Linear(2, 2)}, options=unickpt.SaveOptions(timeout=timeout))
        out: dict = {"error": None}
    except unickpt.CheckpointError as e:
        out = {"error": type(e).__name__, "missing": list(getattr(e, "missing_ranks", []) or []), "text": str(e)}
    out["seconds"] = time.monotonic() - t0
    dist.barrier()
    return out
