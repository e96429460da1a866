"""The background save worker: one thread per process running save jobs in submission order,
and the bookkeeping of saves whose outcome nobody has seen yet.

Each ``Checkpointer`` owns one ``SaveWorker``. Its save pipeline (``SavePipeline.start``)
snapshots on the caller's thread, then submits the rest (write, checksums, commit collectives on
the checkpointer's ``background`` group) here. Every rank submits the same
saves in the same order, so the collectives of the background group always match across ranks.
It runs at a lower CPU priority (nice +10 on Linux, per thread; the write and checksum threads
it starts inherit it), so that on a busy host the training threads get the cores first and the
save uses what they leave idle (communication waits, data loading).

Failures are never lost. Each async save's ``SaveHandle`` is tracked (``track``) until someone
has seen its outcome: ``handle.wait()``, or the next ``save``/``load`` (``raise_failures``, which
raises one ``AsyncSaveFailures`` naming *every* failed save not yet reported), or
``unickpt.wait_all()``, or ``CheckpointManager.wait()`` for a manager's saves (``owner``).

Exit. A process does not exit while a save is queued or writing: at the first submit the worker
registers ``_drain_at_exit`` to run when the interpreter shuts down, before ``concurrent.futures``
refuses new work (``exit_hook``). It waits for every queued save, then reports any failure nobody
has seen on stderr (which checkpoints were not saved, and how to wait for saves) and makes the
process exit with status 1 once the ``atexit`` handlers registered after unickpt have run.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from ...errors import AsyncSaveFailures, ConfigurationError, describe_exception
from .exit_hook import run_before_thread_pools_shut_down

if TYPE_CHECKING:
    from ...format.records import Metadata

__all__ = ["SaveHandle", "SaveWorker", "ANY_OWNER"]

BACKGROUND_NICE = 10
ANY_OWNER = object()  # ``take_failures(ANY_OWNER)``: the failures of every owner


def _lower_priority() -> None:
    """Make the calling thread (and threads it creates later) yield CPU to training threads."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


class SaveHandle:
    """Result of ``save``: ``wait()`` blocks until committed (re-raising any error), ``done()`` polls,
    ``wait_snapshot()`` blocks until the state at the call is copied (async saves). ``path``: the
    checkpoint it writes."""

    def __init__(self, future: Future[Metadata | None], snapshot: Future[None] | None = None, path: str = "") -> None:
        self._future = future
        self._snapshot = snapshot
        self._reported = False
        self.path = path

    def wait_snapshot(self) -> None:
        """Block until the snapshot is complete: from then on the saved tensors may be changed in
        any way. (``optimizer.step()`` waits for it by itself.) A failed copy is reported by
        ``wait()``, not here."""
        if self._snapshot is not None:
            self._snapshot.exception()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Metadata | None:
        """Block until the save is committed; returns the metadata on rank 0 (None elsewhere)."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:  # = TimeoutError: also the save's own (CollectiveTimeoutError)
            if not self._future.done():
                raise TimeoutError("checkpoint save still running") from None
            self._reported = True
            raise
        except BaseException:
            self._reported = True
            raise

    def join(self, timeout: float | None = None) -> bool:
        """Block until the save finished (committed or failed) without raising; True if it did."""
        try:
            self._future.exception(timeout)
        except FutureTimeout:
            return False
        return True

    def take_unreported_error(self) -> BaseException | None:
        """For a finished save: its error if nobody has seen it yet (then it counts as seen)."""
        if not self._future.done() or self._reported:
            return None
        err = self._future.exception()
        self._reported = err is not None
        return err


class SaveWorker:
    """The worker thread, the saves it still owes a report for, and the exit drain."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._tracked: list[tuple[object, SaveHandle]] = []  # (owner, handle), oldest first
        self._lock = threading.Lock()
        self._exit_hook = False
        self._failed_at_exit = False
        self._closed = False

    def submit(self, fn: Callable[[], object]) -> Future:
        with self._lock:
            if self._closed:
                raise ConfigurationError("this Checkpointer is closed: create a new one to save")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="unickpt-save", initializer=_lower_priority)
            if not self._exit_hook:
                self._exit_hook = True
                me = weakref.ref(self)
                run_before_thread_pools_shut_down(lambda: _at_exit(me, "_drain_at_exit"))
                atexit.register(_at_exit, me, "_exit_status")  # runs after threading's shutdown
            fut = self._pool.submit(fn)
            self._pending = [f for f in self._pending if not f.done()] + [fut]
            return fut

    def close(self) -> None:
        """Wait for every queued save, then stop the worker thread (later submits are refused).
        Failures nobody has seen stay reportable (``raise_failures``)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def drain(self) -> None:
        """Wait until every submitted job has finished (errors are reported by their handles)."""
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            try:
                f.result()
            except BaseException:
                pass

    # ------------------------------------------------------------------ failure reports

    def track(self, handle: SaveHandle, owner: object = None) -> None:
        """Report ``handle``'s failure later if nobody waits on it (``owner``: who reports it)."""
        with self._lock:
            self._tracked.append((owner, handle))

    def finished(self, owner: object = None) -> int:
        """How many of ``owner``'s tracked saves, oldest first, have finished (a prefix: the
        worker runs them in order)."""
        with self._lock:
            mine = [h for o, h in self._tracked if o is owner]
        n = 0
        while n < len(mine) and mine[n].done():
            n += 1
        return n

    def take_failures(self, owner: object = None, first: int | None = None) -> list[tuple[str, BaseException]]:
        """The failures nobody has seen of ``owner``'s finished saves (only its ``first`` oldest
        tracked ones, if given), oldest first; they count as seen and stop being tracked."""
        with self._lock:
            mine = [h for o, h in self._tracked if (owner is ANY_OWNER or o is owner)]
            mine = [h for h in (mine if first is None else mine[:first]) if h.done()]
            taken = {id(h) for h in mine}
            self._tracked = [(o, h) for o, h in self._tracked if id(h) not in taken]
        out = []
        for h in mine:
            err = h.take_unreported_error()
            if err is not None:
                out.append((h.path, err))
        return out

    def raise_failures(self, owner: object = None, what: str = "", first: int | None = None) -> None:
        """Raise one ``AsyncSaveFailures`` for every unseen failure of ``owner`` (if any).

        ``first``: only among its oldest ``first`` tracked saves. ``save`` passes the number of
        saves finished on *every* rank (gathered in its first collective), so that all ranks
        report the same saves even when one rank's worker finished a failed save a moment
        before another's."""
        failures = self.take_failures(owner, first)
        if failures:
            raise AsyncSaveFailures(failures, what)

    def wait_all(self) -> None:
        """Wait for every queued save, then raise the failures nobody has seen (all owners)."""
        self.drain()
        self.raise_failures(ANY_OWNER)

    # ------------------------------------------------------------------ exit

    def _drain_at_exit(self) -> None:
        try:
            self.drain()
            failures = self.take_failures(ANY_OWNER)
        except BaseException as e:  # never break the interpreter's shutdown
            failures = [("(unknown)", e)]
        if not failures:
            return
        self._failed_at_exit = True
        n = len(failures)
        lines = [
            f"unickpt: {n} asynchronous save{'s' if n > 1 else ''} failed and nobody waited for "
            f"{'them' if n > 1 else 'it'}; {'these checkpoints were' if n > 1 else 'this checkpoint was'} NOT saved:"
        ]
        lines += [f"  {path}: {describe_exception(e)}" for path, e in failures]
        lines.append(
            "Wait for asynchronous saves before the script ends (handle.wait(), unickpt.wait_all() or "
            "CheckpointManager.wait()), and before torch.distributed.destroy_process_group(), which also "
            "destroys unickpt's process groups. Exiting with status 1."
        )
        # the process is exiting: stderr is the only place left to say it (like an uncaught error)
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()

    def _exit_status(self) -> None:
        """Make a process whose last saves failed exit non-zero (after flushing logs)."""
        if not self._failed_at_exit:
            return
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(1)


def _at_exit(worker: weakref.ref[SaveWorker], method: str) -> None:
    """Call ``method`` of the worker if it still exists (a collected worker has nothing queued)."""
    w = worker()
    if w is not None:
        getattr(w, method)()
