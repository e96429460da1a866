"""The test suite's entry points to ``unickpt.testing.launch`` (the one launcher of tests and
benchmarks): N gloo ranks in fresh processes, results in the safe value encoding, never pickle.

* ``run_ranks(fn, ws, *args)``: every rank's result; a failing rank's traceback is raised as an
  AssertionError.
* ``launch_ranks(fn, ws, *args, victim=r)``: a rank that is expected to die (fault injection);
  survivors get ``grace`` seconds, then SIGKILL; one ``RankOutcome`` per rank.
* ``run_jobs([(fn, args), ...])``: independent one-process jobs at the same time.

Tests use one torch thread per process (2 cores shared by several ranks). Their ranks never see
a GPU (``CUDA_VISIBLE_DEVICES`` empty in the children): they are gloo CPU tests, and on a machine
with fewer GPUs than ranks torch's default device mesh (``fully_shard`` without a mesh) would put
rank r on ``cuda:r`` and fail ("invalid device ordinal", seen on a one-GPU machine).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from unickpt.testing.launch import RankOutcome, RanksFailed, free_port
from unickpt.testing.launch import launch_ranks as _launch_ranks
from unickpt.testing.launch import run_jobs as _run_jobs
from unickpt.testing.launch import run_ranks as _run_ranks

__all__ = ["free_port", "run_ranks", "launch_ranks", "run_jobs", "RankOutcome"]


@contextmanager
def _cpu_children() -> Iterator[None]:
    """Processes started inside see no GPU (the variable is read when a child first touches CUDA)."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240, init_timeout: float | None = None
) -> list[Any]:
    try:
        with _cpu_children():
            return _run_ranks(fn, world_size, *args, timeout=timeout, threads=1, init_timeout=init_timeout)
    except RanksFailed as e:
        raise AssertionError(str(e)) from None


def launch_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    victim: int | None = None,
    timeout: float = 180.0,
    grace: float = 3.0,
) -> list[RankOutcome]:
    with _cpu_children():
        return _launch_ranks(fn, world_size, *args, victim=victim, timeout=timeout, grace=grace, threads=1)


def run_jobs(jobs: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]], timeout: float = 180.0) -> list[RankOutcome]:
    with _cpu_children():
        return _run_jobs(jobs, timeout=timeout, threads=1)
