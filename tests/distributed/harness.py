"""Run a function on N gloo ranks inside one pytest test (see ``unickpt.tools.launch``).

Tests use one torch thread per rank (2 cores shared by several ranks) and report a failing
child's traceback as an AssertionError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unickpt.tools.launch import RanksFailed, free_port
from unickpt.tools.launch import run_ranks as _run_ranks

__all__ = ["free_port", "run_ranks"]


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240, init_timeout: float | None = None
) -> list[Any]:
    try:
        return _run_ranks(fn, world_size, *args, timeout=timeout, threads=1, init_timeout=init_timeout)
    except RanksFailed as e:
        raise AssertionError(str(e)) from None
