"""Functions run on spawned gloo ranks by tests/integration/coordination/test_coordination_objects_processes.py:
unickpt's object collectives (``coordination.objects`` through ``TorchDistCoordinator``), with
every ``torch.distributed`` transfer they make counted. Each returns plain values."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.distributed as dist

BIG = 20_000  # bytes: over every slot (4 KiB at most)

_COUNTED = ("all_gather", "broadcast", "gather", "scatter", "send", "recv", "isend", "irecv")


def obj_of(rank: int, big: bool) -> dict[str, Any]:
    """What rank ``rank`` contributes: small, or ``BIG`` bytes when ``big``."""
    return {"rank": rank, "text": "r" * rank, "blob": bytes([rank]) * (BIG if big else 3)}


def _counting() -> Counter[str]:
    counts: Counter[str] = Counter()
    for name in _COUNTED:
        original = getattr(dist, name)

        def counted(*a: Any, _f: Any = original, _n: str = name, **k: Any) -> Any:
            counts[_n] += 1
            return _f(*a, **k)

        setattr(dist, name, counted)
    return counts


def collectives(rank: int, ws: int, big_ranks: list[int]) -> dict[str, Any]:
    """Each object collective once through a ``TorchDistCoordinator`` (ranks in ``big_ranks`` send
    large objects; the broadcast and scatter sources are rank 1, the gather destination rank 2):
    what this rank got, and the transfers each made."""
    from unickpt.coordination.torch_dist import CheckpointGroups, TorchDistCoordinator

    coord = TorchDistCoordinator(CheckpointGroups())
    counts = _counting()
    out: dict[str, Any] = {}

    def run(name: str, fn: Any) -> None:
        counts.clear()
        out[name] = {"got": fn(), "calls": dict(counts)}

    run("all_gather", lambda: coord.all_gather_object(obj_of(rank, rank in big_ranks)))
    run("broadcast", lambda: coord.broadcast_object(obj_of(rank, rank in big_ranks) if rank == 1 else None, src=1))
    run("gather", lambda: coord.gather_object(obj_of(rank, rank in big_ranks), dst=2))
    objs = [obj_of(10 + r, r in big_ranks) for r in range(ws)] if rank == 1 else None
    run("scatter", lambda: coord.scatter_object(objs, src=1))
    return out


def subgroup(rank: int, ws: int) -> dict[str, Any]:
    """The same collectives on a group of global ranks [1, 2] (group rank 0 is global rank 1):
    the global/group rank mapping of gather's and scatter's point-to-point transfers."""
    from unickpt.coordination import objects

    group = dist.new_group([1, 2])
    if rank not in (1, 2):
        return {}
    members = [1, 2]
    return {
        "all_gather": objects.all_gather(group, 2, obj_of(rank, True)),
        "broadcast": objects.broadcast(group, 2, obj_of(rank, True), 2, rank == 2),
        "gather": objects.gather(group, 2, obj_of(rank, True), 1, rank == 1, members),
        "scatter": objects.scatter(
            group, 2, [obj_of(7, True), obj_of(8, True)] if rank == 2 else None, 2, rank == 2, members
        ),
    }


def codecs(rank: int, ws: int) -> dict[str, Any]:
    """The RAM tier's codecs: JSON values (one of them large) and raw bytes (small and large)."""
    from unickpt.coordination import objects

    group = dist.new_group(backend="gloo")
    value = {"rank": rank, "steps": list(range(rank * 3000))}  # rank 2's is over the slot
    small = bytes([rank]) * 10 if rank == 0 else None
    large = bytes([9]) * BIG if rank == 1 else None
    return {
        "json": objects.all_gather(group, ws, value, objects.JSON),
        "raw_small": objects.broadcast(group, ws, small, 0, rank == 0, objects.RAW),
        "raw_large": objects.broadcast(group, ws, large, 1, rank == 1, objects.RAW),
    }
