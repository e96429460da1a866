"""Run a function on N local ranks (spawned processes): for tests, benchmarks and quick
multi-rank experiments. The one launcher of the project: the test harnesses and ``bench/`` use it.

Three entry points over one mechanism (``_Spawned``):

* ``run_ranks(fn, world_size, *args)``: the ranks join a gloo process group on a free local
  port, each calls ``fn(rank, world_size, *args)``; returns every rank's result, or raises
  ``RanksFailed`` with the first failing rank's traceback (a rank that raises, dies or does not
  finish within ``timeout`` fails the call instead of hanging it).
* ``launch_ranks(fn, world_size, *args, victim=r)``: for fault injection. Waits until the
  ``victim`` rank has exited (it is expected to die, e.g. SIGKILL itself at a chosen point), gives
  the survivors ``grace`` seconds to finish or fail on their own (gloo notices a dead peer), then
  SIGKILLs the rest; returns one ``RankOutcome`` per rank (exit code, ``ok`` / ``error`` /
  ``killed``, result or traceback), so the caller can inspect what the job left behind.
* ``run_jobs([(fn, args), ...])``: independent one-process jobs at the same time (no process
  group, ``fn(0, 1, *args)``), one ``RankOutcome`` per job.

How results travel: each process writes its report to its own file in a private temporary
folder, under a temporary name renamed into place once complete, so a process killed at any
point leaves a whole report or none. A result is written in unickpt's safe value encoding
(``format.values``: plain values, tensors, numpy arrays, nested dicts/lists/tuples), never
pickle, so the parent runs no code from a child's output; a result that encoding refuses makes
the rank fail. An error travels as its traceback text. ``fn`` must be importable (a module-level
function); the children are spawned (not forked) and are not daemons, so they may start
processes of their own.

Start-up cost (``preload``). A spawned process imports torch and unickpt again (seconds of CPU
each, most of a short multi-rank test). Given ``preload=("torch", ...)``, the processes are
instead forked from multiprocessing's fork server, which imported those modules once (the
first call's list holds for the fork server's life, i.e. the calling process's): each starts
with them imported and untouched (the server runs nothing else; no CUDA, no process group), and
takes the caller's environment variables as they are at that call (the server's own were those
of the first call). Tensors among the arguments (in lists, tuples and dicts) travel by value in
the safe value encoding: multiprocessing would pass each one's storage as a file descriptor, and
the fork server takes at most 256 per process. The default (no preload) spawns, for benchmarks
that time a fresh process.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..format.values import dumps_value, loads_value

__all__ = ["free_port", "run_ranks", "launch_ranks", "run_jobs", "RankOutcome", "RanksFailed"]

_POLL_S = 0.02


class RanksFailed(RuntimeError):
    """A rank raised, died or did not finish in time (the message holds its traceback)."""


@dataclass(frozen=True, slots=True)
class RankOutcome:
    """What one process of ``launch_ranks`` / ``run_jobs`` did.

    ``exitcode``: the process's exit code (``-9``: SIGKILLed, by itself or by the launcher);
    ``status``: ``"ok"`` (it returned; ``result`` holds the value), ``"error"`` (it raised;
    ``error`` holds the traceback) or ``"killed"`` (no report: it died, or the launcher killed it
    while it still ran)."""

    rank: int
    exitcode: int | None
    status: str
    result: Any = None
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class _Spec:
    """What one child needs besides ``fn`` and its arguments."""

    rank: int
    world_size: int  # 0: no process group, ``fn`` sees world size 1
    port: int
    threads: int
    init_timeout: float | None
    hard_exit: bool  # os._exit(0) right after the report (never wait for peers or threads)
    report: str  # path prefix of the report files: <report>.ok / <report>.err
    env: dict[str, str] | None = None  # forked from the fork server: the caller's environment


@dataclass(frozen=True, slots=True)
class _ByValue:
    """A tensor argument in the safe value encoding (``_by_value`` / ``_from_value``)."""

    data: bytes


def _by_value(x: Any) -> Any:
    """``x`` with the tensors inside its lists, tuples and dicts (exact types) encoded by value."""
    import torch

    if isinstance(x, torch.Tensor) and type(x) is torch.Tensor:
        return _ByValue(dumps_value(x, "argument"))
    if type(x) in (list, tuple):
        return type(x)(_by_value(v) for v in x)
    if type(x) is dict:
        return {k: _by_value(v) for k, v in x.items()}
    return x


def _from_value(x: Any) -> Any:
    if type(x) is _ByValue:
        return loads_value(x.data, "argument")
    if type(x) in (list, tuple):
        return type(x)(_from_value(v) for v in x)
    if type(x) is dict:
        return {k: _from_value(v) for k, v in x.items()}
    return x


def _write_report(prefix: str, kind: str, data: bytes) -> None:
    tmp = f"{prefix}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, f"{prefix}.{kind}")


def _outlive_peers(spec: _Spec, limit_s: float = 60.0) -> None:
    """Rank 0 hosts the job's store: it leaves after every other rank has reported (at most
    ``limit_s``), so a peer still waiting on the store is not cut off by its exit. A forked
    process exits at once where a spawned one spent a while tearing its interpreter down."""
    folder = os.path.dirname(spec.report)
    peers = [os.path.join(folder, f"p{r}") for r in range(1, spec.world_size)]
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all(os.path.exists(p + ".ok") or os.path.exists(p + ".err") for p in peers):
            return
        time.sleep(_POLL_S)


def _entry(spec: _Spec, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """The child's main function: join the group, run ``fn``, write the report.

    A process that dies by a fatal signal (SIGABRT of a glibc heap check, SIGSEGV, SIGBUS, SIGFPE,
    SIGILL) first writes every thread's Python stack on its stderr (``faulthandler``): the one
    clue left by a crash seen once in a long run (issue 39, item 27). The exit code stays the
    signal's; SIGKILL (fault injection) is untouched."""
    import datetime
    import faulthandler

    try:
        faulthandler.enable(all_threads=True)
    except (RuntimeError, ValueError, OSError):  # no usable stderr: the run goes on without the stacks
        pass

    import torch
    import torch.distributed as dist

    if spec.env is not None:  # forked from the fork server: the caller's environment, not the server's
        os.environ.clear()
        os.environ.update(spec.env)
        args = _from_value(args)
    torch.set_num_threads(spec.threads)
    rank, ws = spec.rank, spec.world_size
    try:
        if ws > 0:
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(spec.port),
                RANK=str(rank),
                WORLD_SIZE=str(ws),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(ws),
            )
            timeout = None if spec.init_timeout is None else datetime.timedelta(seconds=spec.init_timeout)
            dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=timeout)
        result = fn(rank, max(ws, 1), *args)
        _write_report(spec.report, "ok", dumps_value(result, f"rank {rank} result"))
    except BaseException:
        try:
            _write_report(spec.report, "err", traceback.format_exc().encode())
        finally:
            os._exit(1)  # do not wait on peers stuck in a collective
    if spec.hard_exit:
        os._exit(0)
    if rank == 0 and ws > 1:
        _outlive_peers(spec)
    if ws > 0:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


class _Spawned:
    """The processes one call started (``fn`` on ``max(world_size, 1)`` ranks), and their
    report files in ``folder``."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        world_size: int,
        folder: str,
        threads: int | None,
        init_timeout: float | None,
        hard_exit: bool,
        preload: Sequence[str] = (),
    ) -> None:
        import torch.multiprocessing as mp

        n = max(world_size, 1)
        threads = threads if threads is not None else max(1, (os.cpu_count() or 1) // n)
        port = free_port() if world_size > 0 else 0
        env = dict(os.environ) if preload else None
        self.specs = [
            _Spec(r, world_size, port, threads, init_timeout, hard_exit, os.path.join(folder, f"p{r}"), env)
            for r in range(n)
        ]
        ctx: Any = mp.get_context("forkserver" if preload else "spawn")
        if preload:
            ctx.set_forkserver_preload(list(preload))
        if preload:
            args = _by_value(args)
        self.procs = [ctx.Process(target=_entry, args=(s, fn, args)) for s in self.specs]
        try:
            for p in self.procs:
                p.start()
        except BaseException:
            self.stop(0)
            raise

    def state(self, i: int) -> str | None:
        """``"ok"`` / ``"error"`` (reported), ``"dead"`` (exited without a report) or None (running)."""
        prefix = self.specs[i].report
        for _ in range(2):  # once more after seeing the exit: the report is renamed in before it
            if os.path.exists(prefix + ".err"):
                return "error"
            if os.path.exists(prefix + ".ok"):
                return "ok"
            if self.procs[i].exitcode is None:
                return None
        return "dead"

    def alive(self) -> bool:
        return any(p.exitcode is None for p in self.procs)

    def stop(self, join_s: float) -> None:
        """Give every started process ``join_s`` seconds (together) to exit, then SIGKILL it."""
        deadline = time.monotonic() + join_s
        for p in self.procs:
            if p.pid is None:  # never started
                continue
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()

    def result(self, i: int) -> Any:
        with open(self.specs[i].report + ".ok", "rb") as f:
            return loads_value(f.read(), f"rank {self.specs[i].rank} result")

    def error(self, i: int) -> str:
        with open(self.specs[i].report + ".err", "rb") as f:
            return f.read().decode(errors="replace")

    def outcome(self, i: int, label: int) -> RankOutcome:
        code = self.procs[i].exitcode
        state = self.state(i)
        if state == "ok":
            return RankOutcome(label, code, "ok", self.result(i))
        if state == "error":
            return RankOutcome(label, code, "error", error=self.error(i))
        return RankOutcome(label, code, "killed")


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 600,
    threads: int | None = None,
    init_timeout: float | None = None,
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes joined by gloo; their results.

    ``world_size=0`` runs one process without a process group (``fn`` sees world size 1). Each
    process gets ``threads`` torch threads (default: the cores divided among the ranks).
    ``init_timeout``: the ``timeout`` (seconds) given to ``init_process_group`` (torch's default
    when None). ``preload``: fork the processes from a fork server that imported these modules
    (module docstring). Raises ``RanksFailed`` (the lowest failing rank's traceback) as soon as a rank
    fails, when a rank dies without a report, or after ``timeout`` seconds."""
    n = max(world_size, 1)
    folder = tempfile.mkdtemp(prefix="unickpt-ranks-")
    try:
        ranks = _Spawned(fn, args, world_size, folder, threads, init_timeout, hard_exit=False, preload=preload)
        deadline = time.monotonic() + timeout
        states: list[str | None] = [None] * n
        try:
            while True:
                states = [ranks.state(i) for i in range(n)]
                if "error" in states or "dead" in states or all(s == "ok" for s in states):
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(_POLL_S)
        finally:
            ranks.stop(30 if all(s == "ok" for s in states) else 0.5)
        errors = [i for i in range(n) if ranks.state(i) == "error"]
        if errors:
            raise RanksFailed(f"rank {errors[0]} of {n} failed:\n{ranks.error(errors[0])}")
        if not all(s == "ok" for s in states):
            codes = {r: p.exitcode for r, p in enumerate(ranks.procs)}
            raise RanksFailed(f"ranks did not finish within {timeout}s or died (exit codes {codes})")
        return [ranks.result(i) for i in range(n)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def launch_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    victim: int | None = None,
    timeout: float = 180.0,
    grace: float = 3.0,
    threads: int | None = None,
    init_timeout: float | None = None,
    preload: Sequence[str] = (),
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on gloo ranks where one may die on purpose; one
    ``RankOutcome`` per rank (see the module docstring).

    Waits until ``victim`` has exited (without a victim: until every rank has), at most
    ``timeout`` seconds, then at most ``grace`` seconds more for the others, then SIGKILLs every
    process still running. A rank exits right after writing its report (it does not wait for
    peers or background threads that may be stuck on a dead peer)."""
    n = max(world_size, 1)
    if victim is not None and not 0 <= victim < n:
        raise ValueError(f"victim rank {victim} is not a rank of world size {n}")
    folder = tempfile.mkdtemp(prefix="unickpt-ranks-")
    try:
        ranks = _Spawned(fn, args, world_size, folder, threads, init_timeout, hard_exit=True, preload=preload)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and ranks.alive():
                if victim is not None and ranks.procs[victim].exitcode is not None:
                    break
                time.sleep(_POLL_S)
            grace_end = min(deadline, time.monotonic() + grace)
            while time.monotonic() < grace_end and ranks.alive():
                time.sleep(_POLL_S)
        finally:
            ranks.stop(0)
        return [ranks.outcome(i, i) for i in range(n)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_jobs(
    jobs: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]],
    timeout: float = 180.0,
    threads: int | None = None,
    preload: Sequence[str] = (),
) -> list[RankOutcome]:
    """Run independent one-process jobs (``fn(0, 1, *args)``, no process group) at the same
    time and wait for all (at most ``timeout`` seconds, then SIGKILL); one ``RankOutcome`` per
    job, its ``rank`` being the job's index."""
    threads = threads if threads is not None else max(1, (os.cpu_count() or 1) // max(len(jobs), 1))
    folder = tempfile.mkdtemp(prefix="unickpt-jobs-")
    try:
        started: list[_Spawned] = []
        try:
            for i, (fn, args) in enumerate(jobs):
                sub = os.path.join(folder, f"job{i}")
                os.mkdir(sub)
                started.append(_Spawned(fn, args, 0, sub, threads, None, hard_exit=True, preload=preload))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(s.alive() for s in started):
                time.sleep(_POLL_S)
        finally:
            for s in started:
                s.stop(0)
        return [s.outcome(0, i) for i, s in enumerate(started)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
