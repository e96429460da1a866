"""Ctrl-C during a save: the save is finished on every rank first, then ``KeyboardInterrupt``.

A save is collective and its commit is one decision for the whole job: a ``KeyboardInterrupt``
raised half-way leaves the other ranks in a collective (until the save's timeout) and the save's
write and commit on the background worker, which would commit it after the caller saw the
exception (issue 39, item 10). So ``Checkpointer.save`` (and ``CheckpointManager.save``) run
inside ``SaveInterrupts``: a SIGINT that arrives meanwhile is *deferred*. The call keeps
running until the save is committed or has failed on every rank, then raises
``KeyboardInterrupt`` whose message says which (chained to the save's error if it failed: a save
fails before its commit, and nothing of it is committed, unless what failed came after the commit,
e.g. its ``hf_export``, which the error says). When
the exception arrives, the folder's state is decided: the new checkpoint committed, or the
previous one intact, and nothing changes afterwards. For an async save, the call defers only
until the save is handed to the worker (its snapshot taken on every rank); that save goes on and
commits (``wait_all()`` / the exit drain wait for it), as any async save does.

Every Ctrl-C while deferred writes one line on stderr (the first: what happens; later ones:
still finishing); the wait is bounded by the save's collectives' timeout (``SaveOptions.timeout``).
SIGQUIT (Ctrl-\\) or SIGTERM/SIGKILL stop the process at once: the commit is atomic, so the
folder then holds the previous checkpoint or the new one, never a mix.

Deferral needs the main thread (where Python runs signal handlers) and Python's default SIGINT
handler (``signal.default_int_handler``); a handler of the application's own stays in place
(deferring would hide its behaviour). There, and for a save called on another thread, a
``KeyboardInterrupt`` that still reaches the blocking wait (``wait_through``) makes the call wait
for the save's outcome before re-raising it.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

from .worker import SaveHandle

if TYPE_CHECKING:
    from ...format.records import Metadata

__all__ = ["SaveInterrupts", "wait_through"]


class SaveInterrupts:
    """Context manager around one save call (module docstring). ``what``: the save, as its
    messages name it (``"save of /ckpt/step_2"``); ``async_save``: the call returns at the
    hand-over to the worker. Nested use (a manager's save calling the
    checkpointer's) defers once, in the outermost."""

    def __init__(self, what: str, async_save: bool = False) -> None:
        self.what, self.async_save = what, async_save
        self.count = 0  # SIGINTs received while deferring
        self._previous: object = None
        self._active = False

    def __enter__(self) -> SaveInterrupts:
        if threading.current_thread() is not threading.main_thread():
            return self
        current = signal.getsignal(signal.SIGINT)
        if current is not signal.default_int_handler:  # the application's own, or ours (nested)
            return self
        try:
            self._previous = signal.signal(signal.SIGINT, self._deferred)
        except ValueError:  # not the main interpreter: Python's own handling stays
            return self
        self._active = True
        return self

    def _deferred(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 1:
            line = (
                f"unickpt: interrupted during the {self.what}: finishing it on every rank first (it commits "
                "or fails as a whole), then KeyboardInterrupt is raised. Ctrl-\\ (SIGQUIT) stops at once; "
                "the folder then holds the previous checkpoint or the new one\n"
            )
        else:
            line = f"unickpt: still finishing the {self.what} (at most its timeout); KeyboardInterrupt follows\n"
        try:  # a signal handler: no buffered stream (the main thread may be inside a write to it)
            os.write(2, line.encode(errors="replace"))
        except OSError:
            pass

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._active:
            self._active = False
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
        if not self.count or isinstance(exc, KeyboardInterrupt):
            return
        if exc is None:
            done = (
                "was handed to the background worker first (it goes on and commits; wait_all() waits for it)"
                if self.async_save
                else "was committed first"
            )
            raise KeyboardInterrupt(f"interrupted during the {self.what}, which {done}")
        raise KeyboardInterrupt(
            f"interrupted during the {self.what}, which failed first ({type(exc).__name__}: the __cause__ "
            "says whether its checkpoint was committed)"
        ) from exc


def wait_through(handle: SaveHandle, what: str) -> Metadata | None:
    """``handle.wait()`` that, when a ``KeyboardInterrupt`` reaches it anyway (module docstring),
    first waits until the save finished (committed or failed on every rank), then re-raises it
    with what happened: the folder's state is decided when the exception arrives."""
    try:
        return handle.wait()
    except KeyboardInterrupt as interrupt:
        while True:
            try:
                handle.join()
                break
            except KeyboardInterrupt:  # one more Ctrl-C: keep waiting (bounded by the save's timeout)
                continue
        error = handle.take_unreported_error()
        outcome = (
            "committed"
            if error is None
            else f"failed ({type(error).__name__}: the __cause__ says whether its checkpoint was committed)"
        )
        raise KeyboardInterrupt(f"interrupted during the {what}, which {outcome} first") from (error or interrupt)
