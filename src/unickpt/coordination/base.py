"""Coordinator protocol: the collectives planning and commit need, nothing more.

Every rank of a save/load calls the same methods in the same order (they are collectives).
``run_stage`` is the error-agreement wrapper the engine uses around local work: each rank runs
its part, then all ranks exchange success/failure, so that one failing rank makes every rank raise
the same error (see ``outcomes``) instead of leaving the others blocked in the next collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .outcomes import Outcome, disagreement, pack, stage_error
from .store import StoreScope

__all__ = ["Coordinator", "Settle", "Share", "run_stage"]

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

    # the job's key-value store, under keys of this coordinator's group, that the commit barrier
    # reports through (coordination.barrier); None where there is none (one process)
    def store_scope(self) -> StoreScope | None: ...


@dataclass(frozen=True, slots=True)
class Settle:
    """A count that rides along a stage's all_gather: ``count()`` on every rank, then, once the
    stage succeeded, ``apply(the smallest count of all ranks)`` on every rank (it may raise).
    The save pipeline's describe stage (``SavePipeline.describe``) uses it to report only the async
    saves finished on every rank."""

    count: Callable[[], int]
    apply: Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Share:
    """A value that rides along a stage's all_gather: ``value(result)`` on every rank whose part
    succeeded, then, once the stage succeeded, ``apply(every rank's value, in rank order)`` on
    every rank. The load's validate stage (``engine.load.pipeline``) combines every rank's
    missing and unexpected keys with it, in the stage's own round trip."""

    value: Callable[[Any], object]
    apply: Callable[[list[object]], None]


def run_stage(
    coord: Coordinator,
    stage: str,
    fn: Callable[[], T],
    *,
    agree: Callable[[T], Mapping[str, object]] | None = None,
    settle: Settle | None = None,
    share: Share | None = None,
) -> T:
    """Run ``fn`` locally, then agree across ranks (one all_gather; none for one process).

    A failure anywhere makes every rank raise the same error (``outcomes.stage_error``: the
    failing ranks' common ``CheckpointError`` type, else ``RankFailures``), at every world size.
    ``agree(result)``: values every rank must share, e.g. ``{"path": url}``; when they differ every
    rank raises ``RankDisagreementError`` (carried by the same all_gather, no extra round trip).
    ``settle``: see ``Settle``; ``share``: see ``Share`` (both on the same all_gather)."""
    result: T | None = None
    error: BaseException | None = None
    claims: tuple[tuple[str, str], ...] = ()
    shared: object = None
    try:
        result = fn()
        claims = () if agree is None else tuple((k, repr(v)) for k, v in agree(result).items())
        shared = None if share is None else share.value(result)
    except Exception as e:  # reported to every rank below
        error = e
    count = settle.count() if settle is not None else 0
    if error is not None:
        mine = pack(error, transport=coord.world_size > 1, count=count)
    else:
        mine = Outcome(claims=claims, count=count, shared=shared)
    outcomes = [mine] if coord.world_size == 1 else coord.all_gather_object(mine)
    failed = {r: o for r, o in enumerate(outcomes) if o.error_type is not None}
    if failed:
        raise stage_error(stage, failed, coord.rank, error) from error
    refused = disagreement(stage, {r: o.claims for r, o in enumerate(outcomes)}) if agree is not None else None
    if refused is not None:
        raise refused
    if settle is not None:
        settle.apply(min(o.count for o in outcomes))
    if share is not None:
        share.apply([o.shared for o in outcomes])
    return result  # type: ignore[return-value]
