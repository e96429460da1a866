"""Split tensors of a save plan (pure functions): tensors every rank holds one ``torch.chunk``
of, rank r chunk r (FSDP's ``Shard(0)`` over the whole job, ZeRO-3), laid out alike in every
rank's files so the metadata describes them once (``format.layouts.SplitLayout``) instead of one
row per rank.

``plan.plan_save`` applies the rule (``chunk_dims``: through ``templates.chunk_rule`` to each
rank's table, and ``split_dims`` to the written boxes) and gives each split tensor its part
(``split_parts``); each rank's bytes are laid out by ``layout``. The rule (the tests' oracle
states it on records: tests/support/save_oracle.py):
- a tensor is split when it has at least one dimension, some elements, and every rank whose
  chunk is not empty writes exactly that chunk along one dimension (chunk r of ``world`` parts,
  ``torch.chunk``'s rule, the other dimensions whole); ranks past the last non-empty chunk write
  nothing of it, and its layout says so;
- each split tensor gets one part of every rank by the size of chunk 0 (largest first to the
  part with the fewest bytes, ties in the job's tensor order: the same on every rank);
- each rank's files: the split tensors' chunks first, in the job's tensor order, each at the next
  64-byte boundary (where ``SplitLayout`` computes them), then the rank's other entries (replicated
  boxes it writes, irregular shards, blobs), largest first to the file with the fewest bytes;
- if that would leave a rank without a file a layout names, only tensors without empty chunks
  are split; if that fails too, none (``plan.plan_save``'s attempts).
"""

from __future__ import annotations

import numpy as np

from .layout import largest_first

__all__ = ["chunk_dims", "split_dims", "split_parts"]


def chunk_dims(
    shape: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, rank: int | np.ndarray, world: int
) -> np.ndarray:
    """Per row (padded global shape, offsets, lengths of a box held by ``rank``: one for all
    rows, or one per row): the dimension ``d`` when the box is ``torch.chunk`` part ``rank`` of
    its tensor along ``d`` over ``world`` parts (every other dimension whole, and part 0 not the
    whole extent), else -1. At most one dimension can match. The one statement of the rule:
    ``templates.chunk_rule`` applies it to one rank's table, ``split_dims`` to written boxes."""
    n, width = shape.shape
    if n == 0 or width == 0:
        return np.full(n, -1, dtype=np.int64)
    if isinstance(rank, np.ndarray):
        rank = rank[:, None]
    size = -(-shape // world)
    lo = np.minimum(shape, rank * size)
    rows = np.minimum(shape, lo + size) - lo
    full = (offsets == 0) & (lengths == shape)
    along = (offsets == lo) & (lengths == rows) & (size < shape)
    others_full = (full.sum(axis=1, keepdims=True) - full) == width - 1
    ok = along & others_full
    return np.where(ok.any(axis=1), ok.argmax(axis=1), -1)


def split_dims(
    name: np.ndarray,
    rank: np.ndarray,
    shape: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    space: int,
    world: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per tensor id (``space`` of them): the dimension its written boxes (one row each: tensor
    id, writing rank, padded global shape, offsets, lengths) split it along as ``torch.chunk``
    parts over the ranks, rank r chunk r (``chunk_dims``), every non-empty chunk once; -1 for
    every other tensor. Also per tensor id its number of non-empty chunks."""
    dim = np.full(space, -1, dtype=np.int64)
    chunks = np.zeros(space, dtype=np.int64)
    if world < 2 or not len(name):
        return dim, chunks
    d = chunk_dims(shape, offsets, lengths, rank, world)
    at = np.maximum(d, 0)[:, None]
    extent = np.take_along_axis(shape, at, axis=1)[:, 0]
    n = np.take_along_axis(lengths, at, axis=1)[:, 0]
    size = -(-extent // world)
    ok = (d >= 0) & (n > 0) & (np.prod(shape, axis=1) > 0)
    count = np.bincount(name, minlength=space)
    good = np.bincount(name, weights=ok, minlength=space).astype(np.int64) == count
    low = np.full(space, np.iinfo(np.int64).max, dtype=np.int64)
    high = np.full(space, -1, dtype=np.int64)
    np.minimum.at(low, name, d)
    np.maximum.at(high, name, d)
    np.maximum.at(chunks, name, np.where(ok, -(-extent // np.maximum(size, 1)), 0))
    split = (count > 0) & good & (low == high) & (count == chunks)
    dim[split] = high[split]
    chunks[~split] = 0
    return dim, chunks


def split_parts(split: list[int], chunk0_bytes: list[int], parts: int) -> dict[int, int]:
    """Each split tensor's part (file) on every rank (``split``: tensor ids in the job's tensor
    order; ``chunk0_bytes``: the bytes of each one's chunk 0): largest first to the part with
    the fewest bytes, ties in the tensor order."""
    return dict(zip(split, largest_first(chunk0_bytes, parts)))
