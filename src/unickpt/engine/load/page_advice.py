"""numpy's huge-page advice switched off while the coordinator's read assignment runs.

On Linux numpy asks the kernel to back every large array with 2 MiB pages
(``madvise(MADV_HUGEPAGE)``). The coordinator's read assignment (``engine.load.exchange.read_parts``
over a whole job's needs: millions of rows) allocates and frees a few hundred large temporaries
and gathers from them at random. Where transparent huge pages are on for advised memory (the
kernel's ``madvise`` setting, with its ``defrag`` compaction on fault) that advice makes the same
passes markedly slower (figures: docs/performance.md, "Internals").
``huge_pages_off()`` turns the advice off for its block and restores it after; uses nest and
overlap across threads (the first to enter records the setting, the last to leave restores it).
A process-wide numpy setting: arrays other threads allocate meanwhile get ordinary pages, which
changes only where the kernel puts them. ``huge_pages_off_for(nbytes)`` is the block the read
assignment uses: the switch only where its input is large enough for numpy to advise any array
(``NUMPY_ADVISED_MIN``), so that the loads of small jobs never touch the process's setting.
Where numpy has no such switch (other platforms, other versions) this does nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable
from types import TracebackType
from typing import cast

__all__ = ["NUMPY_ADVISED_MIN", "huge_pages_off", "huge_pages_off_for"]

NUMPY_ADVISED_MIN = 4 << 20  # numpy advises huge pages only for arrays of at least 4 MiB


def _switch() -> Callable[[bool], bool] | None:
    """numpy's setter (returns the previous setting), where this numpy has one."""
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2, numpy 1.x
        try:
            found = importlib.import_module(module).__dict__.get("_set_madvise_hugepage")
        except ImportError:
            continue
        if callable(found):
            return cast(Callable[[bool], bool], found)
    return None


class _Advice:
    """The process's count of blocks in force (numpy's setting is one per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.before = False
        self.switch = _switch()

    def enter(self) -> None:
        with self.lock:
            if self.depth == 0 and self.switch is not None:
                self.before = bool(self.switch(False))
            self.depth += 1

    def leave(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0 and self.switch is not None:
                self.switch(self.before)


_ADVICE = _Advice()


class huge_pages_off:
    """``with huge_pages_off(): ...``: numpy's huge-page advice is off inside (module docstring)."""

    def __enter__(self) -> huge_pages_off:
        _ADVICE.enter()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        _ADVICE.leave()


def huge_pages_off_for(nbytes: int) -> contextlib.AbstractContextManager[object]:
    """``huge_pages_off()`` for a computation over ``nbytes`` of input (the read assignment: the
    needs every rank reported, 24 bytes a need) that can allocate arrays numpy advises: from
    ``NUMPY_ADVISED_MIN // 8`` bytes of input on (a margin of 8: its arrays hold a few 8-byte
    columns a need); below, a block that leaves numpy's setting alone."""
    return huge_pages_off() if nbytes >= NUMPY_ADVISED_MIN // 8 else contextlib.nullcontext()
