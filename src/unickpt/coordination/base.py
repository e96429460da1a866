"""Coordinator protocol: the collectives planning and commit need, nothing more.

Every rank of a save/load calls the same methods in the same order (they are collectives).
``run_stage`` is the error-agreement wrapper the engine uses around local work: each rank runs
its part, then all ranks exchange success/failure, so that one failing rank makes every rank raise
the same ``RankFailures`` instead of leaving the others blocked in the next collective.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ..errors import CheckpointError, RankFailures

__all__ = ["Coordinator", "run_stage"]

T = TypeVar("T")


class Coordinator(Protocol):
    rank: int
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any: ...

    def barrier(self) -> None: ...

    # point-to-point byte transfer (uint8 CPU tensors), used by the distributed load; only
    # called when world_size > 1
    def isend(self, tensor: Any, dst: int, tag: int) -> Any: ...

    def irecv(self, tensor: Any, src: int, tag: int) -> Any: ...


def run_stage(coord: Coordinator, stage: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` locally, then agree across ranks; re-raise a lone local error unchanged."""
    result: T | None = None
    error: BaseException | None = None
    try:
        result = fn()
    except Exception as e:  # reported to every rank below
        error = e
    msg = None if error is None else _describe(error)
    if coord.world_size == 1:
        if error is not None:
            raise error
        return result  # type: ignore[return-value]
    outcomes = coord.all_gather_object(msg)
    failures = {r: m for r, m in enumerate(outcomes) if m is not None}
    if not failures:
        return result  # type: ignore[return-value]
    if error is not None and isinstance(error, CheckpointError) and len(failures) == 1:
        raise _with_rank(error, coord.rank, stage)
    raise RankFailures(stage, failures) from error


def _with_rank(error: CheckpointError, rank: int, stage: str) -> CheckpointError:
    """The same error type, its message prefixed with the rank and stage (if not already)."""
    msg = str(error)
    if msg.startswith(f"rank {rank}"):
        return error
    try:
        new = type(error)(f"rank {rank}, {stage}: {msg}")
    except TypeError:  # an error type with another constructor: keep it as it is
        return error
    new.__cause__ = error.__cause__
    new.__traceback__ = error.__traceback__
    return new


def _describe(e: BaseException) -> str:
    if isinstance(e, CheckpointError):
        return f"{type(e).__name__}: {e}"
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"
