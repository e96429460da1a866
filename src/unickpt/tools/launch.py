"""Run a function on N local gloo ranks: for tests, benchmarks and quick multi-rank experiments.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh (spawned) processes, joins them
with a gloo process group on a free local port, calls ``fn(rank, world_size, *args)`` in each and
returns every rank's result. Results travel in unickpt's safe value encoding (plain values,
tensors, numpy arrays, nested dicts/lists/tuples: ``format.values``), never pickle, so the
parent runs no code from a child's output. The first failing
rank's traceback is re-raised in the caller; a rank that dies or a run past ``timeout`` fails the
call instead of hanging it. ``fn`` must be importable (a module-level function).
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..format.values import dumps_value, loads_value

__all__ = ["free_port", "run_ranks", "RanksFailed"]


class RanksFailed(RuntimeError):
    """A rank raised, died or did not finish in time (the message holds its traceback)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    q: Any,
    init_timeout: float | None = None,
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if world_size > 0:
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
            )
            timeout = None if init_timeout is None else datetime.timedelta(seconds=init_timeout)
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
        result = fn(rank, max(world_size, 1), *args)
        # bytes, by value: torch's queue reducers would share memory with a child about to exit
        q.put((rank, "ok", dumps_value(result, f"rank {rank} result")))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        os._exit(1)  # do not wait on peers stuck in a collective
    if world_size > 0:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 600,
    threads: int | None = None,
    init_timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes joined by gloo.

    ``world_size=0`` runs one process without a process group (``fn`` sees world size 1). Each
    process gets ``threads`` torch threads (default: the cores divided among the ranks).
    ``init_timeout``: the ``timeout`` (seconds) given to ``init_process_group`` (torch's default
    when None). The children are not daemons, so they may start processes of their own."""
    import torch.multiprocessing as mp

    n = max(world_size, 1)
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // n)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, threads, fn, args, q, init_timeout)) for r in range(n)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < n:
            if not q.empty():
                rank, status, payload = q.get()
                (results if status == "ok" else errors)[rank] = payload
                if errors:
                    break
                continue
            if time.monotonic() > deadline:
                break
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.5)
                if q.empty():
                    break
            time.sleep(0.02)
        time.sleep(0.1)
        while not q.empty():
            rank, status, payload = q.get()
            (results if status == "ok" else errors)[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise RanksFailed(f"rank {rank} of {n} failed:\n{errors[rank]}")
    if len(results) < n:
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        raise RanksFailed(f"ranks did not finish within {timeout}s or died (exit codes {codes})")
    return [loads_value(results[r], f"rank {r} result") for r in range(n)]
