"""The test suite's entry points to ``unickpt.testing.launch`` (the one launcher of tests and
benchmarks): N gloo ranks in fresh processes, results in the safe value encoding, never pickle.

* ``run_ranks(fn, ws, *args)``: every rank's result; a failing rank's traceback is raised as an
  AssertionError.
* ``launch_ranks(fn, ws, *args, victim=r)``: a rank that is expected to die (fault injection);
  survivors get ``grace`` seconds, then SIGKILL; one ``RankOutcome`` per rank.
* ``run_jobs([(fn, args), ...])``: independent one-process jobs at the same time.
* ``SaveLoadMatrix(save_many, load_many, cases, root)``: a resharding matrix (checkpoints saved
  at some world sizes, loaded at others) in the fewest spawns.
* ``run_ranks(calls_in_turn, ws, [[fn, args], ...])``: several rank functions in one spawn.

Tests use one torch thread per process (2 cores shared by several ranks), and their processes
start forked from a fork server that imported ``PRELOAD`` once (``unickpt.testing.launch``:
each process starts with those modules imported and untouched, and the test's environment), not
as fresh interpreters that import torch again: that import was most of a short test's time. Their ranks never see
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

# imported once by the fork server the test processes start from: what every rank imports
# (``unickpt.api`` brings the save and load pipelines and torch.distributed.tensor)
PRELOAD = ("torch", "torch.distributed", "unickpt", "unickpt.api")

__all__ = ["free_port", "run_ranks", "launch_ranks", "run_jobs", "RankOutcome", "SaveLoadMatrix", "calls_in_turn"]


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
            return _run_ranks(
                fn, world_size, *args, timeout=timeout, threads=1, init_timeout=init_timeout, preload=PRELOAD
            )
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
        return _launch_ranks(
            fn, world_size, *args, victim=victim, timeout=timeout, grace=grace, threads=1, preload=PRELOAD
        )


def run_jobs(jobs: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]], timeout: float = 180.0) -> list[RankOutcome]:
    with _cpu_children():
        return _run_jobs(jobs, timeout=timeout, threads=1, preload=PRELOAD)


# ----------------------------------------------------------------------------- save/load matrix

Case = tuple[str, int, str, int]  # (source spec, source world size, destination spec, destination world size)


def saves_then_loads(
    rank: int,
    ws: int,
    save_many: Callable[..., list[Any]],
    saves: list[list[Any]],
    load_many: Callable[..., list[Any]],
    loads: list[list[Any]],
) -> list[list[Any]]:
    """One job of ``run_save_load_matrix``: ``save_many(rank, ws, saves)``, then
    ``load_many(rank, ws, loads)`` (every load's checkpoint was saved by an earlier job)."""
    return [save_many(rank, ws, saves) if saves else [], load_many(rank, ws, loads) if loads else []]


class SaveLoadMatrix:
    """A resharding matrix: every source of ``cases`` (and ``extra_sources``) saved once and every
    case's load run, in as few spawned jobs as the rule "a load runs in a later job than its save"
    allows: one job per world size does that size's saves and the loads whose checkpoint an
    earlier job saved. The jobs are planned at once and run lazily, in order, as far as the first
    ``source``/``load`` asking for a result needs (so the work spreads over the tests that ask).

    ``save_many(rank, ws, [[spec, ckpt], ...])`` returns one result per save (rank 0's is the
    reference); ``load_many(rank, ws, [[spec, ckpt, ref], ...])`` one result per load. ``run(fn,
    ws, *args)`` runs one job (default: ``run_ranks``)."""

    def __init__(
        self,
        save_many: Callable[..., list[Any]],
        load_many: Callable[..., list[Any]],
        cases: Sequence[Case],
        root: str,
        extra_sources: Sequence[tuple[str, int]] = (),
        run: Callable[..., list[Any]] = run_ranks,
    ) -> None:
        self._save_many, self._load_many, self._root, self._run = save_many, load_many, root, run
        to_save = sorted({(s, w) for s, w, _, _ in cases} | set(extra_sources))
        to_load = list(dict.fromkeys(cases))
        done: set[tuple[str, int]] = set()
        self.jobs: list[tuple[int, list[tuple[str, int]], list[Case]]] = []  # (ws, saves, loads)
        partial = False  # a loads-only job waits until all of its size's loads are ready, unless stuck
        while to_save or to_load:
            planned = False
            for ws in sorted({w for _, w in to_save} | {c[3] for c in to_load}):
                saves = [s for s in to_save if s[1] == ws]
                pending = [c for c in to_load if c[3] == ws]
                ready = [c for c in pending if (c[0], c[1]) in done]
                if saves or (ready and (partial or len(ready) == len(pending))):
                    self.jobs.append((ws, saves, ready))
                    done.update(saves)
                    to_save = [s for s in to_save if s not in saves]
                    to_load = [c for c in to_load if c not in ready]
                    planned = True
            assert planned or not partial, f"no job can run: {to_load}"
            partial = not planned
        self._next = 0
        self.saved: dict[tuple[str, int], tuple[str, Any]] = {}
        self.loaded: dict[Case, list[Any]] = {}

    def _run_next(self) -> None:
        ws, saves, loads = self.jobs[self._next]
        save_args = [[spec, os.path.join(self._root, f"{spec}-{ws}")] for spec, _ in saves]
        load_args = [[dst, *self.saved[(src, src_ws)]] for src, src_ws, dst, _ in loads]
        per_rank = self._run(saves_then_loads, ws, self._save_many, save_args, self._load_many, load_args)
        for i, (source, (_, ckpt)) in enumerate(zip(saves, save_args)):
            self.saved[source] = (ckpt, per_rank[0][0][i])
        for i, case in enumerate(loads):
            self.loaded[case] = [r[1][i] for r in per_rank]
        self._next += 1

    def source(self, spec: str, ws: int) -> tuple[str, Any]:
        """``(ckpt, rank 0's save result)`` of a source."""
        while (spec, ws) not in self.saved:
            self._run_next()
        return self.saved[(spec, ws)]

    def load(self, case: Case) -> list[Any]:
        """Every rank's load result of ``case``."""
        while case not in self.loaded:
            self._run_next()
        return self.loaded[case]

    def run_all(self) -> SaveLoadMatrix:
        while self._next < len(self.jobs):
            self._run_next()
        return self


def calls_in_turn(rank: int, ws: int, calls: list[list[Any]]) -> list[Any]:
    """Several rank functions in one spawned job: ``fn(rank, ws, *args)`` for each ``[fn, args]``
    of ``calls`` in turn; their results (``run_ranks(calls_in_turn, ws, calls)`` instead of one
    spawn per call)."""
    return [fn(rank, ws, *args) for fn, args in calls]
