"""Warnings while a rank waits in one of unickpt's collectives: who has not arrived yet.

A rank that skips a save leaves the others waiting up to the collective's deadline (the job's
timeout: 30 minutes by default). The deadline stays; meanwhile every ``interval`` seconds of
waiting, the waiting rank logs one warning (``logging.getLogger("unickpt")``) naming the ranks
that have not arrived yet, read from the arrival counts in the job's store (``torch_dist``).

Order of use: ``torch_dist.TorchDistCoordinator`` calls ``WAITS.watch(...)`` as each of its
collectives (flat, or a whole tree collective) starts, with the function that names the missing
ranks, and ``WAITS.done(ticket)`` when it returns or fails; the same around unickpt's group
creation and point-to-point waits. One daemon thread per process (started by the first watched
wait) sleeps until the next warning is due: a collective that completes within ``interval``
costs a dictionary insert and delete. The commit barrier (``barrier``) watches its store waits
the same way (naming the ranks whose report is missing, read over ``StoreScope.watch_store``).

Only ranks below ``NAMING_RANKS`` read the arrivals for the names (a bounded load on the store
at any world size); the others warn that they wait and point to those ranks' warnings.

The interval: ``CoordinationOptions.wait_warning_s``, else ``$UNICKPT_WAIT_WARNING_S``, else
60 s (``topology.DEFAULT_WAIT_WARNING_S``), read when a ``Checkpointer`` is created.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Waits", "WAITS", "wait_warning", "NAMING_RANKS", "names_missing", "OTHERS_NAME_THEM"]

# Which ranks read the arrivals to name the missing ranks: ranks below NAMING_RANKS (every rank of
# a job of at most NAMING_RANKS ranks). Reading them costs a store request or two per rank of the
# job, every interval: at 4,096 ranks, 8 readers make 64 Ki requests a minute to the store's host,
# where every rank reading would make 32 Mi. The other ranks' warnings point to theirs.
NAMING_RANKS = 8
OTHERS_NAME_THEM = f"the warnings of ranks 0 to {NAMING_RANKS - 1} name the ranks that have not arrived"


def names_missing(rank: int) -> bool:
    """Whether ``rank``'s wait warnings read the arrivals (``NAMING_RANKS``)."""
    return rank < NAMING_RANKS


_LOG = logging.getLogger("unickpt")

# the ranks not arrived yet (None: unknown), or a text saying whom the wait is for
MissingRanks = Callable[[], "list[int] | str | None"]


def wait_warning(
    what: str, waited: float, limit: float, missing: list[int] | None, rank: int | None = None, who: str = ""
) -> str:
    """The text of one warning: ``what`` (e.g. "save of /ckpt: all_gather_object (collective #3
    on its foreground group)") has waited ``waited`` of ``limit`` seconds for ``missing`` (or
    for what ``who`` says)."""
    hint = ""
    if not who:
        if missing:
            who = f"rank(s) {missing} have not arrived yet"
            hint = (
                ". Every rank must make the same unickpt calls (save, load, CheckpointManager) in the same "
                "order: a rank that skipped one, or is still busy before it, blocks the others"
            )
        elif missing is None:
            who = "the ranks that have not arrived are unknown (the job's store cannot be read)"
        else:
            who = "every rank has arrived; the collective has not completed yet"
    me = "" if rank is None else f"rank {rank}: "
    return f"{me}{what}: still waiting after {waited:.1f}s of at most {limit:g}s: {who}{hint}"


@dataclass(order=True)
class _Watch:
    due: float
    ticket: int
    what: str = field(compare=False)
    rank: int | None = field(compare=False)
    interval: float = field(compare=False)
    limit: float = field(compare=False)
    since: float = field(compare=False)
    missing: MissingRanks = field(compare=False)


class Waits:
    """The waits of one process being watched, and the thread that warns about them."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.log = logger or _LOG
        self._cond = threading.Condition()
        self._active: dict[int, _Watch] = {}
        self._heap: list[_Watch] = []
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None

    def watch(
        self, what: str, interval: float | None, limit: float, missing: MissingRanks, rank: int | None = None
    ) -> int:
        """Warn every ``interval`` seconds (None: never) until ``done(ticket)``: ``what`` has waited
        so long (of ``limit`` seconds) for ``missing()``. Returns the ticket (0: not watched)."""
        if interval is None or interval <= 0:
            return 0
        now = time.monotonic()
        with self._cond:
            ticket = next(self._ids)
            w = _Watch(now + interval, ticket, what, rank, interval, limit, now, missing)
            self._active[ticket] = w
            heapq.heappush(self._heap, w)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="unickpt-wait-warnings", daemon=True)
                self._thread.start()
            elif self._heap[0] is w:
                self._cond.notify()
        return ticket

    def done(self, ticket: int) -> None:
        """The wait of ``ticket`` is over (its entry in the heap is skipped when it comes up)."""
        if ticket:
            with self._cond:
                self._active.pop(ticket, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0].ticket not in self._active:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cond.wait(60.0)
                        continue
                    delay = self._heap[0].due - time.monotonic()
                    if delay <= 0:
                        w = heapq.heappop(self._heap)
                        break
                    self._cond.wait(delay)
            self._warn(w)
            with self._cond:
                if w.ticket in self._active:
                    w.due = time.monotonic() + w.interval
                    heapq.heappush(self._heap, w)

    def _warn(self, w: _Watch) -> None:
        try:
            found = w.missing()
        except Exception:  # naming the missing ranks is best effort; the warning still goes out
            found = None
        if w.ticket not in self._active:
            return  # it completed while the store was read
        missing, who = (None, found) if isinstance(found, str) else (found, "")
        try:
            self.log.warning(wait_warning(w.what, time.monotonic() - w.since, w.limit, missing, w.rank, who))
        except Exception:  # a broken log handler never stops the warnings of other waits
            pass


WAITS = Waits()
"""The process's watcher (one thread for every checkpointer of the process)."""
