"""Load planning: target boxes of one rank + checkpoint metadata -> which saved shards to read
and which sub-boxes to copy where (pure functions).

Called by ``engine.read`` on every rank after the metadata is read and validated. Validation
(``check_targets``) runs first and collects every problem (missing / unexpected keys under the
strictness, shape and dtype mismatches) before any byte is read. Then ``plan_local_load``
intersects each target box with the saved boxes of its tensor: every element of every target is
covered exactly once because saved boxes tile their tensor (checked at save and on decode).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..errors import DtypeMismatchError, MissingKeysError, ShapeMismatchError, UnexpectedKeysError
from ..format.records import Metadata
from .boxes import intersect
from .specs import Shape, ShardSpec

__all__ = ["CopyOp", "ShardRead", "KeyReport", "check_targets", "keys_error", "plan_local_load"]


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


@dataclass(frozen=True, slots=True)
class KeyReport:
    """Keys skipped by a non-strict load."""

    missing: tuple[str, ...]  # wanted by the live state, absent from the checkpoint
    unexpected: tuple[str, ...]  # in the checkpoint, not wanted by the live state


def check_targets(
    md: Metadata,
    specs: list[ShardSpec],
    *,
    strict: bool,
    source: str,
    checkpoint_keys: set[str] | None = None,
    cast_dtypes: bool = False,
) -> KeyReport:
    """Validate targets against the metadata; raise one error listing every problem.

    ``checkpoint_keys``: the saved fqns this load is responsible for (default: all tensors), so a
    load of only the model does not call the optimizer's tensors unexpected. ``cast_dtypes``:
    differing dtypes are converted while loading instead of refused. Under ``strict`` missing and
    unexpected keys raise (``keys_error``); else they are reported.
    """
    wanted = {s.fqn: s for s in specs}
    saved = set(md.tensors) if checkpoint_keys is None else checkpoint_keys
    missing = sorted(set(wanted) - set(md.tensors))
    unexpected = sorted(saved - set(wanted))
    shape_problems, dtype_problems = [], []
    for fqn, spec in wanted.items():
        rec = md.tensors.get(fqn)
        if rec is None:
            continue
        if tuple(rec.shape) != tuple(spec.global_shape):
            shape_problems.append(f"{fqn}: checkpoint shape {rec.shape}, live shape {spec.global_shape}")
        elif rec.dtype != spec.dtype and not cast_dtypes:
            dtype_problems.append(f"{fqn}: checkpoint dtype {rec.dtype}, live dtype {spec.dtype}")
    if shape_problems:
        raise ShapeMismatchError(f"shape mismatch loading {source}:" + _listing(shape_problems, 10))
    if dtype_problems:
        raise DtypeMismatchError(
            f"dtype mismatch loading {source}:"
            + _listing(dtype_problems, 10)
            + "\nCast the live model to the checkpoint's dtypes before loading (model.to(dtype)), or pass "
            "options=unickpt.LoadOptions(cast_dtypes=True) to convert each tensor while loading (as Tensor.to)"
        )
    if strict and (missing or unexpected):
        raise keys_error(missing, unexpected, source)
    return KeyReport(tuple(missing), tuple(unexpected))


def _listing(lines: list[str], cap: int) -> str:
    out = "".join(f"\n  {x}" for x in lines[:cap])
    return out + (f"\n  ... and {len(lines) - cap} more" if len(lines) > cap else "")


def keys_error(missing: list[str], unexpected: list[str], source: str) -> MissingKeysError | UnexpectedKeysError:
    """The strict-load error for these keys: MissingKeysError when some are missing (listing the
    unexpected ones too), else UnexpectedKeysError."""
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} key(s) of the live state are not in checkpoint {source}: "
            + ", ".join(missing[:20])
            + (" ..." if len(missing) > 20 else "")
        )
    if unexpected:
        parts.append(
            f"{'the ' if missing else ''}checkpoint {source} has {len(unexpected)} key(s) the live state lacks: "
            + ", ".join(unexpected[:20])
            + (" ..." if len(unexpected) > 20 else "")
        )
    hint = "pass strict=False to load the keys both have" if missing else "pass strict=False to ignore them"
    msg = "; ".join(parts) + f" ({hint})"
    return MissingKeysError(msg) if missing else UnexpectedKeysError(msg)


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
