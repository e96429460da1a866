"""Load planning: target boxes of one rank + checkpoint metadata -> which saved shards to read
and which sub-boxes to copy where (pure functions).

Called by ``engine.load_pipeline`` on every rank after the metadata is read and validated. Validation
(``check_targets``, from ``format.validation``, re-exported here) runs first and collects every
problem (missing / unexpected keys under the strictness, shape and dtype mismatches) before any
byte is read. Then ``plan_local_load`` intersects each target box with the saved boxes of its
tensor: every element of every target is covered exactly once because saved boxes tile their
tensor (checked at save and on decode). The shards overlapping each target come from a
``planning.shard_index.ShardIndex`` (bisection, O(log N + overlaps) per target, not a scan of
every saved shard).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..format.records import Metadata
from ..format.validation import KeyReport, Strictness, check_targets, keys_error
from .boxes import intersect
from .shard_index import ShardIndex
from .specs import Shape, ShardSpec

__all__ = ["CopyOp", "ShardRead", "KeyReport", "Strictness", "check_targets", "keys_error", "plan_local_load"]


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy box ``lengths`` from ``src_offsets`` (relative to the saved shard) into local
    destination ``item_index`` at ``dst_offsets`` (relative to its target box)."""

    item_index: int
    src_offsets: Shape
    dst_offsets: Shape
    lengths: Shape


@dataclass(frozen=True, slots=True)
class ShardRead:
    """One saved shard this rank needs, and what to copy out of it."""

    fqn: str
    shard_index: int
    copies: tuple[CopyOp, ...]


def plan_local_load(md: Metadata, specs: list[ShardSpec], index: ShardIndex | None = None) -> list[ShardRead]:
    """For targets ``specs`` (index = local item index), the saved shards to read, in file order.

    ``index``: a :class:`~unickpt.planning.shard_index.ShardIndex` of ``md`` to reuse across
    calls on the same metadata (``engine.load_pipeline`` plans probes and items with one); a
    fresh one otherwise. The saved shards overlapping each target come from it in O(log N +
    overlaps) for the layouts jobs save, so a rank's planning cost does not grow with the number
    of ranks that saved the checkpoint. Raises ValueError if ``index`` belongs to another
    metadata object."""
    if index is None:
        index = ShardIndex(md)
    elif index.md is not md:
        raise ValueError("plan_local_load: the ShardIndex was built for another Metadata object")
    copies: dict[tuple[str, int], list[CopyOp]] = defaultdict(list)
    for idx, spec in enumerate(specs):
        rec = md.tensors.get(spec.fqn)
        if rec is None or spec.numel == 0:
            continue
        for sidx in index.overlapping(spec.fqn, spec.offsets, spec.lengths):
            shard = rec.shards[sidx]
            hit = intersect(spec.offsets, spec.lengths, shard.offsets, shard.lengths)
            if hit is None:
                continue
            offs, lens = hit
            copies[(spec.fqn, sidx)].append(
                CopyOp(
                    idx,
                    tuple(o - s for o, s in zip(offs, shard.offsets)),
                    tuple(o - t for o, t in zip(offs, spec.offsets)),
                    lens,
                )
            )
    reads = [ShardRead(fqn, sidx, tuple(ops)) for (fqn, sidx), ops in copies.items()]

    def order(r: ShardRead) -> tuple[int, int]:
        s = md.tensors[r.fqn].shards[r.shard_index]
        return (s.file_index, s.byte_offset)

    reads.sort(key=order)
    return reads
