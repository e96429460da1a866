"""Python's cyclic garbage collector paused while a stage builds one record per tensor.

A job with many small tensors holds 10^5 to 10^6 objects the collector tracks (modules,
parameters, their DTensor specs, optimizer state dicts). The describe, plan and stage stages of
a save, the validation of a load and the commit build a few records per tensor (specs, pieces,
plan entries, metadata records): 10^5 allocations that trigger full collections, each
traversing the whole heap (tenths of a second each, several per save: docs/performance.md), and
find nothing: those records hold no reference cycles and are freed by reference counting.

``gc_paused()`` disables the collector for its block. Uses nest and overlap (the caller's thread
and the save worker): the first to enter records whether the collector was enabled, the last
to leave re-enables it only then, so a job that runs with ``gc.disable()`` keeps it disabled.
(A ``gc.disable()``/``gc.enable()`` of another thread inside the block is undone at its end.)

One scope per public call, and only while the caller waits for it:
  ``engine.save.pipeline.SavePipeline.start`` (``GCHold``): a blocking save from its describe
      stage to the end of its commit; an async save only for describe + plan + stage, released
      before its write and commit are handed to the worker, so the background commit of an
      async save runs with the collector on (the job keeps allocating meanwhile). A blocking
      save started while an earlier async save of the same process still commits pauses the
      collector for that overlap (it is one switch per process);
  ``engine.load.pipeline.LoadPipeline.run``: a load's validation, reads and apply.
``SaveOptions.pause_gc`` / ``LoadOptions.pause_gc`` = False: no pause at all (``enabled``).
"""

from __future__ import annotations

import gc
import threading
from types import TracebackType

__all__ = ["gc_paused", "GCHold"]


class _Pauses:
    """The process's count of pauses in force (the collector is one per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.was_enabled = False

    def enter(self) -> None:
        with self.lock:
            if self.depth == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.depth += 1

    def leave(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0 and self.was_enabled:
                gc.enable()


_PAUSES = _Pauses()


class gc_paused:
    """``with gc_paused(): ...``: the collector is off inside (see the module docstring);
    ``gc_paused(False)`` changes nothing."""

    __slots__ = ("_enabled",)

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = enabled

    def __enter__(self) -> None:
        if self._enabled:
            _PAUSES.enter()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._enabled:
            _PAUSES.leave()


class GCHold:
    """The collector paused from construction until ``release()`` (idempotent, from any
    thread): a blocking save holds it from its describe stage on the caller's thread to the end
    of its commit on the worker, so the records it builds die before any collection sees them.
    ``GCHold(False)`` holds nothing."""

    __slots__ = ("_guard", "_held")

    def __init__(self, enabled: bool = True) -> None:
        self._guard = threading.Lock()
        self._held = enabled
        if enabled:
            _PAUSES.enter()

    def release(self, *_: object) -> None:
        with self._guard:
            if not self._held:
                return
            self._held = False
        _PAUSES.leave()
