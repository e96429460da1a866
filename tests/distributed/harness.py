"""Run a function on N gloo ranks inside one pytest test.

``run_ranks(fn, world_size, *args)`` spawns N processes (a free port, a timeout), initialises
torch.distributed with gloo, calls ``fn(rank, world_size, *args)`` and re-raises the first
child's traceback in the parent. ``fn`` must be importable (a module-level function).
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, q: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # plain pickle by value: torch's queue reducers would share memory with a dying child
        q.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        os._exit(1)  # do not wait on peers stuck in a collective
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks; return each rank's result (must be picklable)."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, q), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    while len(results) + len(errors) < world_size:
        if not q.empty():
            rank, status, payload = q.get()
            (results if status == "ok" else errors)[rank] = payload
            if errors:
                break
            continue
        if time.monotonic() > deadline:
            break
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead and q.empty():
            time.sleep(0.5)
            if q.empty():
                break
        time.sleep(0.02)
    time.sleep(0.1)
    while not q.empty():
        rank, status, payload = q.get()
        (results if status == "ok" else errors)[rank] = payload
    for p in procs:
        p.join(timeout=5 if not errors else 0.5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    if len(results) < world_size:
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        raise AssertionError(f"ranks did not finish within {timeout}s or died (exit codes {codes})")
    # results are our own children's, pickled by value just above (test-only code)
    return [pickle.loads(results[r]) for r in range(world_size)]
