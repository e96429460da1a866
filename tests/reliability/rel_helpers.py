"""Helpers for the reliability tests: tiny states, bit-exact comparison, fault injection and a
launcher for multi-rank jobs in which a rank is killed on purpose.

``launch(fn, world_size, *args, victim=r)`` spawns the ranks (gloo, like ``harness.run_ranks``),
waits until the victim rank is dead, gives the survivors ``grace`` seconds to fail on their own
(gloo notices a dead peer) and then SIGKILLs them, so the parent can inspect the folder the job
left behind. Each rank's result or traceback comes back through a file. Children call
``kill_at_phase`` / ``kill_in_commit`` to die by SIGKILL at an exact point of a save.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from harness import free_port

# ----------------------------------------------------------------------------- tiny states


def tiny_model(seed: int = 0, width: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A two-layer MLP with AdamW state (one step taken), deterministic in ``seed``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, optim, seed)
    return model, optim


def step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(10_000 + seed)
    x = torch.randn(4, model[0].in_features, generator=g)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def snapshot(model: nn.Module, optim: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, cloned (collective for sharded models)."""
    from unickpt.tools.toy import full_state

    return full_state(model, optim)


def mismatches(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ bit for bit (or are missing on either side)."""

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    keys = set(got) | set(ref)
    return sorted(
        k
        for k in keys
        if k not in got
        or k not in ref
        or got[k].dtype != ref[k].dtype
        or got[k].shape != ref[k].shape
        or not torch.equal(raw(got[k]), raw(ref[k]))
    )


# ----------------------------------------------------------------------------- fault injection


def kill_at_phase(phase: str, rank: int, nth: int = 1) -> None:
    """SIGKILL this process at the ``nth`` event ``phase`` emitted by ``rank``."""
    import unickpt

    seen = [0]

    def listener(ev: Any) -> None:
        if ev.phase == phase and ev.rank == rank:
            seen[0] += 1
            if seen[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    unickpt.default_checkpointer().events.add_listener(listener)


def kill_in_commit(where: str) -> None:
    """SIGKILL this process in the metadata commit: ``"enter"`` right before the temporary
    metadata file is written, ``"rename"`` after it is written and fsynced, before the rename."""
    from unickpt.format.records import METADATA_FILE
    from unickpt.storage.commit import RenamePublisher

    if where == "enter":
        real_publish = RenamePublisher.publish

        def publish(self: RenamePublisher, name: str, data: bytes) -> None:
            if name == METADATA_FILE:
                os.kill(os.getpid(), signal.SIGKILL)
            real_publish(self, name, data)

        RenamePublisher.publish = publish  # type: ignore[method-assign]
    elif where == "rename":
        real_replace = os.replace

        def replace(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
            if os.path.basename(str(dst)) == METADATA_FILE:  # relative to a folder fd, or a path
                # the temporary metadata is complete on disk
                assert os.stat(src, dir_fd=kw.get("src_dir_fd")).st_size > 0
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst, *a, **kw)

        os.replace = replace  # type: ignore[assignment]
    else:
        raise ValueError(where)


# ----------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    exitcode: int | None  # -9: SIGKILLed (by itself or by the launcher)
    status: str  # "ok", "error", "killed" (no report: died or was killed by the launcher)
    result: Any = None
    error: str = ""


def _child(rank: int, ws: int, port: int, fn: Callable[..., Any], args: tuple, outdir: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    try:
        if ws > 1:
            dist.init_process_group("gloo", rank=rank, world_size=ws)
        result = fn(rank, ws, *args)
        with open(os.path.join(outdir, f"rank{rank}.ok"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # never wait for peers or background threads stuck on a dead peer


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    outdir: str,
    victim: int | None = None,
    timeout: float = 180.0,
    grace: float = 3.0,
) -> dict[int, RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on spawned gloo ranks; see the module docstring."""
    os.makedirs(outdir, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, fn, args, outdir), daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if victim is not None and procs[victim].exitcode is not None:
            break
        if all(p.exitcode is not None for p in procs):
            break
        time.sleep(0.05)
    grace_end = min(deadline, time.monotonic() + grace)
    while time.monotonic() < grace_end and any(p.exitcode is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join(10)
    out = {}
    for r, p in enumerate(procs):
        ok, err = os.path.join(outdir, f"rank{r}.ok"), os.path.join(outdir, f"rank{r}.err")
        if os.path.exists(ok):
            with open(ok, "rb") as f:
                out[r] = RankOutcome(r, p.exitcode, "ok", pickle.load(f))  # our own child's result
        elif os.path.exists(err):
            with open(err) as f:
                out[r] = RankOutcome(r, p.exitcode, "error", error=f.read())
        else:
            out[r] = RankOutcome(r, p.exitcode, "killed")
    return out


def data_files(folder: str) -> list[str]:
    """Every regular file under ``folder`` (relative names), sorted."""
    out = []
    for dirpath, _dirs, files in os.walk(folder):
        for f in files:
            out.append(os.path.relpath(os.path.join(dirpath, f), folder))
    return sorted(out)


def run_jobs(jobs: list[tuple[Callable[..., Any], tuple]], outdir: str, timeout: float = 180.0) -> list[RankOutcome]:
    """Run independent one-process jobs (``fn(0, 1, *args)``) at the same time; wait for all."""
    ctx = mp.get_context("spawn")
    procs = []
    for i, (fn, args) in enumerate(jobs):
        d = os.path.join(outdir, f"job{i}")
        os.makedirs(d, exist_ok=True)
        procs.append((ctx.Process(target=_child, args=(0, 1, 0, fn, args, d), daemon=True), d))
    for p, _ in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p, _ in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(10)
    out = []
    for i, (p, d) in enumerate(procs):
        ok, err = os.path.join(d, "rank0.ok"), os.path.join(d, "rank0.err")
        if os.path.exists(ok):
            with open(ok, "rb") as f:
                out.append(RankOutcome(i, p.exitcode, "ok", pickle.load(f)))
        elif os.path.exists(err):
            with open(err) as f:
                out.append(RankOutcome(i, p.exitcode, "error", error=f.read()))
        else:
            out.append(RankOutcome(i, p.exitcode, "killed"))
    return out
