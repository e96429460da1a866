"""Split tensors of a save plan on columns (pure functions): tensors every rank holds one
``torch.chunk`` of, rank r chunk r (FSDP's ``Shard(0)`` over the whole job, ZeRO-3), laid out
alike in every rank's files so the metadata describes them once (``format.layouts.SplitLayout``)
instead of one row per rank.

``columns.plan_tables`` calls ``split_dims`` on the chosen writers (after ``_choose_writers``,
before the byte layout), ``split_parts`` for the part (file) of each split tensor, and
``lay_out_rank`` for each rank's entries when there are split tensors (``layout.layout_columns``
otherwise). The rule (the tests' oracle states it on records: tests/support/save_oracle.py):
- a tensor is split when it has at least one dimension, some elements, and every rank whose
  chunk is not empty writes exactly that chunk along one dimension (chunk r of ``world`` parts,
  ``torch.chunk``'s rule, the other dimensions whole); ranks past the last non-empty chunk write
  nothing of it, and its layout says so;
- each split tensor gets one part of every rank by the size of chunk 0 (largest first to the
  part with the fewest bytes, ties in the job's tensor order: the same on every rank);
- each rank's files: the split tensors' chunks first, in the job's tensor order, each at the next
  64-byte boundary (where ``SplitLayout`` computes them), then the rank's other entries (replicated
  boxes it writes, irregular shards, blobs), largest first to the file with the fewest bytes;
- if that would leave a rank without a file a layout names (``RankWithoutFile``), only tensors
  without empty chunks are split (``full_chunks``); if that fails too, none.
"""

from __future__ import annotations

import numpy as np

from .layout import largest_first, padded, place

__all__ = ["RankWithoutFile", "split_dims", "full_chunks", "split_parts", "lay_out_rank", "place_others"]


class RankWithoutFile(Exception):
    """A layout part would name a file its rank does not write (the rank holds only empty
    chunks of that part's tensors and nothing else there): the planner lays out fewer split
    tensors, or none."""


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
    parts over the ranks, rank r chunk r, every non-empty chunk once; -1 for every other tensor.
    Also per tensor id its number of non-empty chunks."""
    dim = np.full(space, -1, dtype=np.int64)
    chunks = np.zeros(space, dtype=np.int64)
    if world < 2 or not len(name):
        return dim, chunks
    cut = (offsets != 0) | (lengths != shape)
    d = np.where(cut.sum(axis=1) == 1, cut.argmax(axis=1), 0)
    at = d[:, None]
    extent = np.take_along_axis(shape, at, axis=1)[:, 0]
    lo = np.take_along_axis(offsets, at, axis=1)[:, 0]
    n = np.take_along_axis(lengths, at, axis=1)[:, 0]
    size = -(-extent // world)
    want_lo = np.minimum(extent, rank * size)
    want_n = np.minimum(extent, want_lo + size) - want_lo
    ok = (cut.sum(axis=1) == 1) & (lo == want_lo) & (n == want_n) & (n > 0) & (np.prod(shape, axis=1) > 0)
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


def full_chunks(dim: np.ndarray, chunks: np.ndarray, world: int) -> np.ndarray:
    """``dim`` with only the split tensors whose every chunk has rows."""
    return np.where(chunks == world, dim, -1)


def split_parts(split: list[int], chunk0_bytes: list[int], parts: int) -> dict[int, int]:
    """Each split tensor's part (file) on every rank (``split``: tensor ids in the job's tensor
    order; ``chunk0_bytes``: the bytes of each one's chunk 0): largest first to the part with
    the fewest bytes, ties in the tensor order."""
    return dict(zip(split, largest_first(chunk0_bytes, parts)))


def lay_out_rank(
    sizes: np.ndarray,
    part_of: np.ndarray,
    order_key: np.ndarray,
    rest_key: list[tuple[bool, int, str]],
    parts: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rank's entries (``sizes``: its items' bytes; ``part_of``: each one's layout part, -1
    for the others; ``order_key``: the split ones' place in the job's tensor order;
    ``rest_key``: (is a blob, item index, blob key) of each, the others' tie order among equal
    sizes): the split chunks first in each part in the tensor order, then the others largest
    first to the part with the fewest bytes. Returns the entries' order (indices into ``sizes``,
    grouped by part, each part in byte order), each one's part and byte offset."""
    n = len(sizes)
    at = np.flatnonzero(part_of >= 0)
    at = at[np.lexsort((order_key[at], part_of[at]))]
    part = np.empty(n, dtype=np.int64)
    offset = np.empty(n, dtype=np.int64)
    seq = np.empty(n, dtype=np.int64)
    ends = [0] * parts
    loads = [0] * parts
    for i, (k, size) in enumerate(zip(part_of[at].tolist(), sizes[at].tolist())):
        j = int(at[i])
        part[j], offset[j], seq[j] = k, ends[k], i
        ends[k] += padded(size)
        loads[k] += size
    size_of = sizes.tolist()
    rest = np.flatnonzero(part_of < 0).tolist()
    spots = place_others([size_of[j] for j in rest], [rest_key[j] for j in rest], loads, ends)
    for i, (r, k, off) in enumerate(spots):
        j = rest[r]
        part[j], offset[j], seq[j] = k, off, len(at) + i
    order = np.lexsort((seq, part))
    return order, part[order], offset[order]


def place_others(
    sizes: list[int], ties: list[tuple[bool, int, str]], loads: list[int], ends: list[int]
) -> list[tuple[int, int, int]]:
    """A rank's entries outside the split tensors, after its split chunks (``loads``: the bytes
    each part holds; ``ends``: where each part's next entry starts): largest first, equal sizes
    by ``ties`` (is a blob, item index or 0, blob key), each to the part with the fewest bytes.
    Returns (index into ``sizes``, part, byte offset) in placement order. ``lay_out_rank`` and
    ``templates`` place them with this one rule."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], *ties[i]))
    spots = place([sizes[i] for i in order], loads, ends)
    return [(i, k, off) for i, (k, off) in zip(order, spots)]
