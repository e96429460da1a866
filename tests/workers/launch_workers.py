"""Rank functions of the launcher's own tests (``tests/integration/test_launch_processes.py``).
This module imports nothing but the standard library, so what a rank finds imported came from
its start."""

from __future__ import annotations

import os
import sys
from typing import Any


def environment_and_modules(rank: int, ws: int, names: list[str], modules: list[str]) -> dict[str, Any]:
    """The values of the environment variables ``names`` (None: unset) and which of ``modules``
    this rank had imported when it was called."""
    return {
        "env": {name: os.environ.get(name) for name in names},
        "imported": {name: name in sys.modules for name in modules},
        "world": os.environ.get("WORLD_SIZE"),
    }


def abort_on_a_thread(rank: int, ws: int, err_file: str) -> None:
    """Send this process's stderr (fd 2) to ``err_file``, then abort (SIGABRT, as glibc does on a
    corrupted heap) on a thread of its own while the main thread waits for it."""
    import threading

    fd = os.open(err_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)

    def heap_check_fails_here() -> None:
        os.abort()

    t = threading.Thread(target=heap_check_fails_here, name="aborting")
    t.start()
    t.join()
