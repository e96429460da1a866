"""Which saved shards one rank needs: its target boxes + the checkpoint metadata -> the saved
shards to read and which sub-boxes to copy where (pure functions).

Runs on every rank after the targets are checked (``planning.load.targets``). ``plan_local_load``
intersects each target box with the saved boxes of its tensor: every element of every target is
covered exactly once because saved boxes tile their tensor (checked at save and on decode). The
shards overlapping each target come from a ``planning.load.shards.ShardIndex`` (bisection, O(log N
+ overlaps) per target, not a scan of every saved shard).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...format.dtypes import itemsize
from ...format.layouts import SplitShards
from ...format.records import Metadata, ShardRecord, TensorRecord
from ..boxes import intersect, numel
from ..specs import Shape, ShardSpec
from .runs import needed_rows, row_bytes
from .shards import ShardIndex

__all__ = ["CopyOp", "ShardRead", "plan_local_load", "shard_read"]


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
    """One saved shard this rank needs and what to copy out of it, with what the read engine
    needs of it, so that it looks nothing up again: the shard's record (``shard``: its box and
    bytes), the bytes of one row of its box (``row_bytes``, as ``planning.load.runs.row_bytes``)
    and the rows ``[r0, r1)`` of its box that the copies touch (``rows``, as
    ``planning.load.runs.needed_rows``). Built by ``shard_read``."""

    fqn: str
    shard_index: int
    copies: tuple[CopyOp, ...]
    shard: ShardRecord
    row_bytes: int
    rows: tuple[int, int]


def shard_read(fqn: str, shard_index: int, shard: ShardRecord, itemsize: int, copies: tuple[CopyOp, ...]) -> ShardRead:
    """The ``ShardRead`` of ``copies`` out of saved shard ``shard`` (``fqn``'s shard
    ``shard_index``, elements of ``itemsize`` bytes). One copy of the whole (non-empty) shard,
    the common case, touches all its rows: what ``needed_rows`` says, without asking it."""
    lengths = shard.lengths
    one = copies[0] if len(copies) == 1 else None
    if one is not None and one.lengths == lengths and not any(one.src_offsets) and all(lengths):
        rows = (0, lengths[0]) if lengths else (0, 1)
    else:
        rows = needed_rows(lengths, [(c.src_offsets, c.lengths) for c in copies])
    return ShardRead(fqn, shard_index, copies, shard, row_bytes(lengths, itemsize), rows)


def plan_local_load(md: Metadata, specs: list[ShardSpec], index: ShardIndex | None = None) -> list[ShardRead]:
    """For targets ``specs`` (index = local item index), the saved shards to read, in file order.

    ``index``: a :class:`~unickpt.planning.load.shards.ShardIndex` of ``md`` to reuse across
    calls on the same metadata (``engine.load.pipeline`` plans probes and items with one); a
    fresh one otherwise. The saved shards overlapping each target come from it in O(log N +
    overlaps) for the layouts jobs save, so a rank's planning cost does not grow with the number
    of ranks that saved the checkpoint. A target that is exactly one saved shard (a load at the
    saving job's layout: most targets) takes the shortcut of ``_exact``, which gives what the
    intersection would. Raises ValueError if ``index`` belongs to another metadata object."""
    if index is None:
        index = ShardIndex(md)
    elif index.md is not md:
        raise ValueError("plan_local_load: the ShardIndex was built for another Metadata object")
    tensors = md.tensors
    found: dict[tuple[str, int], tuple[ShardRecord, int, list[CopyOp]]] = {}  # key -> (record, itemsize, copies)

    def add(fqn: str, sidx: int, shard: ShardRecord, rec: TensorRecord, op: CopyOp) -> None:
        known = found.get((fqn, sidx))
        if known is None:
            found[(fqn, sidx)] = (shard, itemsize(rec.dtype), [op])
        else:
            known[2].append(op)

    for idx, spec in enumerate(specs):
        fqn = spec.fqn
        rec = tensors.get(fqn)
        if rec is None or numel(spec.lengths) == 0:
            continue
        exact = _exact(rec, spec)
        if exact is not None:  # all of one saved shard into all of the target: no intersection
            sidx, shard = exact
            zeros = (0,) * len(shard.lengths)
            add(fqn, sidx, shard, rec, CopyOp(idx, zeros, zeros, shard.lengths))
            continue
        for sidx in index.overlapping(fqn, spec.offsets, spec.lengths):
            shard = rec.shards[sidx]
            hit = intersect(spec.offsets, spec.lengths, shard.offsets, shard.lengths)
            if hit is not None:
                offs, lens = hit
                src = tuple(o - s for o, s in zip(offs, shard.offsets))
                add(fqn, sidx, shard, rec, CopyOp(idx, src, tuple(o - t for o, t in zip(offs, spec.offsets)), lens))
    reads = [shard_read(f, i, shard, isz, tuple(ops)) for (f, i), (shard, isz, ops) in found.items()]
    reads.sort(key=_file_order)
    return reads


def _file_order(r: ShardRead) -> tuple[int, int]:
    return (r.shard.file_index, r.shard.byte_offset)


def _exact(rec: TensorRecord, spec: ShardSpec) -> tuple[int, ShardRecord] | None:
    """The saved shard whose box is exactly ``spec``'s (non-empty; its index and record), when
    that takes no search: a regular layout's part (``SplitShards.exact_part``), or a tensor
    saved as one shard; else None (``ShardIndex.overlapping`` then finds the shards)."""
    shards = rec.shards
    if isinstance(shards, SplitShards):
        return shards.exact_part(spec.offsets, spec.lengths)
    if len(shards) == 1:
        only = shards[0]
        if only.offsets == spec.offsets and only.lengths == spec.lengths and type(only.lengths) is tuple:
            return 0, only
    return None
