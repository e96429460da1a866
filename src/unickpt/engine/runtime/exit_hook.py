"""Run code at interpreter exit while ``concurrent.futures`` still accepts work.

At exit, ``threading._shutdown`` first calls the callbacks registered with the private
``threading._register_atexit`` (newest first), then joins the non-daemon threads; the regular
``atexit`` handlers run only after that. ``concurrent.futures.thread`` registers its
``_python_exit`` there when it is imported: from then on every ``ThreadPoolExecutor.submit``
raises "cannot schedule new futures after interpreter shutdown". A save still queued or writing
at exit needs its thread pools, so the save worker's drain is registered there too, *after*
``concurrent.futures.thread`` (imported below), so that it runs first.

This module is the only user of that private API. ``tests/integration/engine/test_exit_drain.py::
test_exit_hook_runs_before_thread_pools_shut_down`` fails when a Python release changes it. On a
Python without it the hook falls back to ``atexit``: saves still running at exit then fail
instead of committing, and that failure is reported (the process exits non-zero).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (registers its shutdown hook before ours)
import threading
from collections.abc import Callable

__all__ = ["run_before_thread_pools_shut_down"]


def run_before_thread_pools_shut_down(fn: Callable[[], None]) -> bool:
    """Call ``fn()`` at interpreter exit, before thread pools refuse work and before non-daemon
    threads are joined. Returns False when only the late ``atexit`` fallback was available (or
    the interpreter is already shutting down, in which case nothing is registered)."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(fn)
        return False
    try:
        register(fn)
    except RuntimeError:  # "can't register atexit after shutdown"
        return False
    return True
