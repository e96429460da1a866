"""The one-process coordinator (framework="torch" or no process group): every collective of
``coordination.base.Coordinator`` answers at once with this rank's own value (world size 1).

``coordination.make_coordinator`` returns it when no process group is initialised (a
single-process save or load); the offline tools (``ops.inspect``, ``ops.merge``, ``ops.pieces``)
run their loads on it directly."""

from __future__ import annotations

from typing import Any

from .store import StoreScope

__all__ = ["SingleProcessCoordinator"]


class SingleProcessCoordinator:
    rank = 0
    world_size = 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        assert objs is not None and len(objs) == 1
        return objs[0]

    def barrier(self) -> None:
        return None

    def isend(self, tensor: Any, dst: int, tag: int) -> Any:
        raise RuntimeError("a single process has no peer to send to")

    def irecv(self, tensor: Any, src: int, tag: int) -> Any:
        raise RuntimeError("a single process has no peer to receive from")

    def store_scope(self) -> StoreScope | None:
        return None
