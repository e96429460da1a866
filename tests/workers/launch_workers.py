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
