"""Per-rank, per-phase events of saves and loads, delivered to the listeners of an ``EventBus``.

Every ``Checkpointer`` owns one bus (``Checkpointer.events``); its save and load pipelines call
``bus.emit(phase, ...)`` at every phase boundary (see ``PHASES``) or wrap a phase in
``with bus.phase(name, rank) as p: ...; p.nbytes = n``. Listeners receive one ``Event`` record
(new fields and new phases never break them: the ``Event`` record is unversioned and only
grows). ``save.groups`` / ``load.groups`` time the coordinator a pipeline gets before its
``*.begin``: a checkpointer's first save or load creates unickpt's process groups there (~15
ms at two ranks), later ones reuse them (microseconds); ``*.begin`` and ``*.end`` start where it
started. Sinks in ``monitoring`` turn events into metrics and views; tests
register listeners to inject faults at an exact phase (kill the process between the last write
and the commit, etc.). Listeners run synchronously on the emitting thread and must be quick. A
listener that raises never fails a save or load: the exception is logged (``unickpt`` logger,
once per listener) and counted in ``EventBus.listener_errors``; only ``BaseException``s that are
not ``Exception``s (``KeyboardInterrupt``, ``SystemExit``) go through.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["Event", "PHASES", "EventBus", "Listener", "Phase", "NO_EVENTS", "instrumented"]

_LOG = logging.getLogger("unickpt")

PHASES = (
    "save.begin",
    "save.plan",
    "save.stage",
    "save.write",
    "save.write.file",
    "save.commit.begin",
    "save.barrier",
    "save.commit",
    "save.finalize",
    "save.end",
    "load.begin",
    "load.metadata",
    "load.plan",
    "load.read",
    "load.read.file",
    "load.copy",
    "load.apply",
    "load.end",
    "save.serialize",
    "load.transfer",
    "storage.retry",
    "save.hf_export",
    "load.describe",
    "load.exchange",
    "load.read.io",
    "load.checksum",
    "save.groups",
    "load.groups",
)


@dataclass(frozen=True, slots=True)
class Event:
    phase: str  # one of PHASES
    rank: int
    t_start: float  # time.perf_counter() at phase start
    t_end: float  # time.perf_counter() at phase end (== t_start for instants)
    nbytes: int = 0
    path: str = ""
    detail: str = ""
    save_id: str = ""
    thread: str = field(default_factory=lambda: threading.current_thread().name)

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start


Listener = Callable[[Event], None]


class EventBus:
    """The listeners of one checkpointer's events (thread-safe; emitting with no listener costs
    one attribute read)."""

    def __init__(self, listeners: Iterable[Listener] = ()) -> None:
        self._listeners: tuple[Listener, ...] = tuple(listeners)
        self._lock = threading.Lock()
        self.listener_errors = 0
        self._reported: set[int] = set()

    def add_listener(self, fn: Listener) -> None:
        with self._lock:
            self._listeners = (*self._listeners, fn)

    def remove_listener(self, fn: Listener) -> None:
        with self._lock:
            self._listeners = tuple(f for f in self._listeners if f is not fn)

    def clear(self) -> None:
        with self._lock:
            self._listeners = ()

    def emit(
        self, phase: str, rank: int, t_start: float | None = None, *, end: float | None = None, **fields: object
    ) -> None:
        """One event of ``phase`` from ``t_start`` (default: now) to ``end`` (default: now)."""
        listeners = self._listeners  # one read: a concurrent add/remove replaces the tuple
        if not listeners:
            return
        now = time.perf_counter() if end is None else end
        ev = Event(phase, rank, now if t_start is None else t_start, now, **fields)  # type: ignore[arg-type]
        for fn in listeners:
            try:
                fn(ev)
            except Exception as e:  # monitoring never fails a checkpoint
                self._listener_failed(fn, e)

    def _listener_failed(self, fn: Listener, e: Exception) -> None:
        with self._lock:
            self.listener_errors += 1
            first = id(fn) not in self._reported
            self._reported.add(id(fn))
        if first:
            _LOG.warning("unickpt event listener %r raised %s: %s (ignored; reported once)", fn, type(e).__name__, e)

    def phase(self, name: str, rank: int, **fields: object) -> Phase:
        """``with bus.phase("save.write", rank, path=...) as p: ...; p.nbytes = n`` emits at exit
        (only if the block succeeded)."""
        return Phase(self, name, rank, fields)


class Phase:
    """A timed phase of one ``EventBus`` (see ``EventBus.phase``)."""

    def __init__(self, bus: EventBus, name: str, rank: int, fields: dict[str, object]) -> None:
        self.bus, self.name, self.rank, self.fields = bus, name, rank, fields
        self.nbytes = 0
        self.t0 = 0.0

    def __enter__(self) -> Phase:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.bus.emit(self.name, self.rank, self.t0, nbytes=self.nbytes, **self.fields)  # type: ignore[arg-type]


def instrumented(phase: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Method decorator: the call is phase ``phase`` of ``self.res.events`` on ``self.coord.rank``
    with ``path=self.storage.url`` (the pipelines' attributes); emitted when the call returns."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def timed(self: Any, *args: Any, **kwargs: Any) -> T:
            with self.res.events.phase(phase, self.coord.rank, path=self.storage.url):
                return fn(self, *args, **kwargs)

        return timed

    return wrap


class _NoEvents(EventBus):
    """The bus of code that runs outside any checkpointer (tools reading one file): listeners
    cannot be added."""

    def add_listener(self, fn: Listener) -> None:
        raise TypeError("NO_EVENTS takes no listeners; add them to a Checkpointer's events")


NO_EVENTS: EventBus = _NoEvents()
