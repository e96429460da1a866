"""Per-rank, per-phase events of saves and loads, delivered to registered listeners.

The engine calls ``emit(phase, ...)`` at every phase boundary (see ``PHASES``); listeners receive
one ``Event`` record (new fields never break them). Sinks in ``monitoring`` turn events into
metrics and views; tests register listeners to inject faults at an exact phase (kill the process
between the last write and the commit, etc.). Listeners run synchronously on the emitting thread
and must be quick; an exception in a listener propagates (that is how faults are injected).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Event", "PHASES", "add_listener", "remove_listener", "clear_listeners", "emit", "phase"]

PHASES = (
    "save.begin",
    "save.plan",
    "save.stage",
    "save.write",
    "save.write.file",
    "save.commit.begin",
    "save.commit",
    "save.end",
    "load.begin",
    "load.metadata",
    "load.plan",
    "load.read",
    "load.end",
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
_LISTENERS: list[Listener] = []
_LOCK = threading.Lock()


def add_listener(fn: Listener) -> None:
    with _LOCK:
        _LISTENERS.append(fn)


def remove_listener(fn: Listener) -> None:
    with _LOCK:
        if fn in _LISTENERS:
            _LISTENERS.remove(fn)


def clear_listeners() -> None:
    with _LOCK:
        _LISTENERS.clear()


def emit(phase: str, rank: int, t_start: float | None = None, **fields: object) -> None:
    if not _LISTENERS:
        return
    now = time.perf_counter()
    ev = Event(phase, rank, now if t_start is None else t_start, now, **fields)  # type: ignore[arg-type]
    for fn in _LISTENERS:
        fn(ev)


class phase:
    """``with phase("save.write", rank, path=...) as p: ...; p.nbytes = n`` emits at exit (if ok)."""

    def __init__(self, name: str, rank: int, **fields: object) -> None:
        self.name, self.rank, self.fields = name, rank, fields
        self.nbytes = 0

    def __enter__(self) -> phase:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            emit(self.name, self.rank, self.t0, nbytes=self.nbytes, **self.fields)
