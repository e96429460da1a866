"""Load planning: target boxes of one rank + checkpoint metadata -> which saved shards to read
and which sub-boxes to copy where (pure functions).

Called by ``engine.load_pipeline`` on every rank after the metadata is read and validated. Validation
(``check_targets``, from ``format.validation``, re-exported here) runs first and collects every
problem (missing / unexpected keys under the strictness, shape and dtype mismatches) before any
byte is read. Then ``plan_local_load`` intersects each target box with the saved boxes of its
tensor: every element of every target is covered exactly once because saved boxes tile their
tensor (checked at save and on decode).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..format.records import Metadata
from ..format.validation import KeyReport, Strictness, check_targets, keys_error
from .boxes import intersect
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


_VECTORIZE_FROM = 16  # tensors with at least this many saved shards are intersected with numpy


def plan_local_load(md: Metadata, specs: list[ShardSpec]) -> list[ShardRead]:
    """For targets ``specs`` (index = local item index), the saved shards to read, in file order.

    Cost is O(targets x saved shards of their tensor), done with numpy for tensors with many
    shards so that planning a load of a checkpoint from thousands of ranks stays fast."""
    copies: dict[tuple[str, int], list[CopyOp]] = defaultdict(list)
    tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for idx, spec in enumerate(specs):
        rec = md.tensors.get(spec.fqn)
        if rec is None or spec.numel == 0:
            continue
        if len(rec.shards) >= _VECTORIZE_FROM and spec.offsets:
            table = tables.get(spec.fqn)
            if table is None:
                table = tables[spec.fqn] = (
                    np.array([s.offsets for s in rec.shards], dtype=np.int64),
                    np.array([s.lengths for s in rec.shards], dtype=np.int64),
                )
            s_off, s_len = table
            t_off = np.array(spec.offsets, dtype=np.int64)
            lo = np.maximum(s_off, t_off)
            hi = np.minimum(s_off + s_len, t_off + np.array(spec.lengths, dtype=np.int64))
            hits = np.nonzero((hi > lo).all(axis=1))[0].tolist()
            candidates = [(int(i), rec.shards[i]) for i in hits]
        else:
            candidates = list(enumerate(rec.shards))
        for sidx, shard in candidates:
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
