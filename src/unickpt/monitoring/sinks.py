"""Where monitoring records go: per-rank JSON-lines files, a per-checkpoint log line, user hooks.

Nothing is recorded or sent anywhere unless a sink is added to a checkpointer's bus::

    sink = unickpt.monitoring.JsonlSink("metrics/")          # one file per rank
    unickpt.default_checkpointer().events.add_listener(sink)
    sink.set_context(step=step, role="actor")                # travels with every record

``JsonlSink`` appends one JSON object per event to ``<folder>/rank<r>.jsonl`` (``Record``
fields: phase, rank, wall-clock start, seconds, bytes, checkpoint path or file, save id, thread,
host, pid, and the step/role of the save when it started: an async save's background phases
keep the step of their call). ``SummaryLogger`` writes one line per save and load through
``logging.getLogger("unickpt")`` (INFO) with blocking time, end-to-end time, bytes and GB/s.
``monitoring.report`` reads the files back (SQLite, heat map, Perfetto trace, stragglers).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from .events import Event

__all__ = ["Record", "JsonlSink", "SummaryLogger", "record_of"]

_LOG = logging.getLogger("unickpt")


@dataclass(frozen=True, slots=True)
class Record:
    phase: str
    rank: int
    start_unix: float
    seconds: float
    bytes: int
    path: str
    save_id: str
    detail: str
    thread: str
    host: str
    pid: int
    step: int | None = None
    role: str | None = None


_CLOCK_OFFSET = time.time() - time.perf_counter()  # perf_counter -> wall clock (per process)


def record_of(ev: Event, step: int | None = None, role: str | None = None) -> Record:
    return Record(
        ev.phase,
        ev.rank,
        ev.t_start + _CLOCK_OFFSET,
        max(0.0, ev.t_end - ev.t_start),
        int(ev.nbytes),
        ev.path,
        ev.save_id,
        ev.detail,
        ev.thread,
        socket.gethostname(),
        os.getpid(),
        step,
        role,
    )


class JsonlSink:
    """A listener appending each event as one JSON line to ``<folder>/rank<r>.jsonl``."""

    def __init__(self, folder: str) -> None:
        self.folder = str(folder)
        os.makedirs(self.folder, exist_ok=True)
        self._lock = threading.Lock()
        self._files: dict[int, Any] = {}
        self._context: tuple[int | None, str | None] = (None, None)
        self._by_save: dict[str, tuple[int | None, str | None]] = {}

    def set_context(self, *, step: int | None = None, role: str | None = None) -> None:
        """The training step and role recorded with the events of saves started from now on."""
        self._context = (step, role)

    def __call__(self, ev: Event) -> None:
        with self._lock:
            if ev.save_id and ev.save_id not in self._by_save:
                if len(self._by_save) > 4096:
                    self._by_save.clear()
                self._by_save[ev.save_id] = self._context
            step, role = self._by_save.get(ev.save_id, self._context) if ev.save_id else self._context
            f = self._files.get(ev.rank)
            if f is None:
                f = open(os.path.join(self.folder, f"rank{ev.rank}.jsonl"), "a", buffering=1)
                self._files[ev.rank] = f
            f.write(json.dumps(asdict(record_of(ev, step, role)), separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


class SummaryLogger:
    """A listener logging one INFO line per save and load on this rank (``unickpt`` logger)."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.log = logger or _LOG
        self._blocking: dict[str, float] = {}

    def __call__(self, ev: Event) -> None:
        if ev.phase == "save.stage" and ev.save_id:
            self._blocking[ev.save_id] = ev.t_end
        elif ev.phase in ("save.end", "load.end"):
            seconds = max(ev.t_end - ev.t_start, 1e-9)
            gbps = ev.nbytes / seconds / 1e9
            if ev.phase == "save.end":
                staged = self._blocking.pop(ev.save_id, None)
                blocking = "" if staged is None else f", blocking {staged - ev.t_start:.3f} s"
                self.log.info(
                    "unickpt save %s rank %d: %.3f s end to end%s, %d bytes, %.2f GB/s",
                    ev.path, ev.rank, seconds, blocking, ev.nbytes, gbps,
                )  # fmt: skip
            else:
                self.log.info("unickpt load %s rank %d: %.3f s", ev.path, ev.rank, seconds)
