"""The byte layout of a save plan, written once (pure functions).

One rank's entries go into its files (parts) by one rule (``lay_out_rank``): its split chunks
(``split``: tensors every rank holds one ``torch.chunk`` of) first, each in its tensor's part, in
the job's tensor order, each at the next aligned offset (``stack``: where ``SplitLayout``
computes them); then its other entries (``place_rest``) largest first, equal sizes in a given
tie order, each to the part holding the fewest bytes so far (split chunks counted), the lowest
part on a tie, at that part's next aligned offset; in a job without split tensors and one file,
its entries in their order. Every entry starts at a multiple of ``ENTRY_ALIGN`` bytes
(``padded``). ``columns`` calls ``lay_out_rank`` for each rank; ``templates`` calls its two steps
itself (``stack`` for a rank's chunks when its plan is asked for, ``place_rest`` for its other
entries at plan time, from every rank's chunk bytes computed at once). ``largest_first`` gives
the split tensors' parts (``split.split_parts``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TypeVar

import numpy as np

from .model import ENTRY_ALIGN

__all__ = ["padded", "lightest_first", "largest_first", "stack", "place_rest", "lay_out_rank"]

N = TypeVar("N", int, np.ndarray)


def padded(nbytes: N) -> N:
    """``nbytes`` rounded up to a multiple of ``ENTRY_ALIGN`` (where the next entry starts)."""
    return -(-nbytes // ENTRY_ALIGN) * ENTRY_ALIGN


def lightest_first(sizes: Iterable[int], loads: list[int]) -> list[int]:
    """The part each of ``sizes`` (in this order) goes to: the one with the fewest bytes so far
    (starting from ``loads``, one per part), the lowest part on a tie."""
    heap = [(load, k) for k, load in enumerate(loads)]
    heapq.heapify(heap)
    out = []
    for size in sizes:
        load, k = heap[0]
        heapq.heapreplace(heap, (load + size, k))
        out.append(k)
    return out


def largest_first(sizes: list[int], parts: int) -> list[int]:
    """The part of each item when the items go largest first (equal sizes in their order) to
    the lightest part."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    out = [0] * len(sizes)
    for i, k in zip(order, lightest_first([sizes[i] for i in order], [0] * parts)):
        out[i] = k
    return out


def stack(part: np.ndarray, sizes: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The byte offset of each entry (in placement order, ``part``: its part) when each goes at
    its part's next aligned offset, the parts' first entries at ``starts`` (one per part)."""
    n = len(part)
    if not n:
        return np.zeros(0, dtype=np.int64)
    by_part = np.argsort(part, kind="stable")
    p = part[by_part]
    aligned = padded(sizes[by_part])
    before = np.cumsum(aligned) - aligned
    first = np.flatnonzero(np.concatenate([[True], p[1:] != p[:-1]]))
    before -= np.repeat(before[first], np.diff(np.append(first, n)))
    out = np.empty(n, dtype=np.int64)
    out[by_part] = before + starts[p]
    return out


def place_rest(
    sizes: np.ndarray, tie: np.ndarray, loads: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A rank's entries outside its split chunks (``loads``: the bytes each part holds so far;
    ``ends``: where each part's next entry starts): largest first, equal sizes in ``tie`` order,
    each to the part with the fewest bytes, the lowest part on a tie, at its next aligned offset.
    Returns the placement order (indices into ``sizes``) and each placed entry's part and
    offset, in that order."""
    order = np.lexsort((tie, -sizes))
    placed = sizes[order]
    part = _lightest_first(placed, len(loads), np.asarray(loads, dtype=np.int64))
    return order, part, stack(part, placed, np.asarray(ends, dtype=np.int64))


def lay_out_rank(
    sizes: np.ndarray,
    parts: int,
    tie: np.ndarray | None = None,
    part_of: np.ndarray | None = None,
    order_key: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rank's entries (``sizes``: their bytes) in its ``parts`` files (module docstring).
    ``part_of``: each entry's split-tensor part, -1 for the others, None in a job without split
    tensors; ``order_key``: the split ones' place in the job's tensor order; ``tie``: the
    others' order among equal sizes (default: their order). Returns the entries' order
    (indices into ``sizes``, grouped by part, each part in byte order), each one's part and
    byte offset."""
    n = len(sizes)
    if tie is None:
        tie = np.arange(n, dtype=np.int64)
    if part_of is None:
        if min(parts, n) <= 1:  # one file: the entries in their order
            aligned = padded(sizes)
            return np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.cumsum(aligned) - aligned
        part_of = np.full(n, -1, dtype=np.int64)
    at = np.flatnonzero(part_of >= 0)
    if order_key is not None:
        at = at[np.lexsort((order_key[at], part_of[at]))]
    chunk_part = part_of[at]
    chunk_sizes = sizes[at]
    loads = np.zeros(parts, dtype=np.int64)
    ends = np.zeros(parts, dtype=np.int64)
    np.add.at(loads, chunk_part, chunk_sizes)
    np.add.at(ends, chunk_part, padded(chunk_sizes))
    rest = np.flatnonzero(part_of < 0)
    rest_order, rest_part, rest_offset = place_rest(sizes[rest], tie[rest], loads, ends)
    index = np.concatenate([at, rest[rest_order]])
    part = np.concatenate([chunk_part, rest_part])
    offset = np.concatenate([stack(chunk_part, chunk_sizes, np.zeros(parts, dtype=np.int64)), rest_offset])
    order = np.argsort(part, kind="stable")  # by part, each part's chunks first, then in placement order
    return index[order], part[order], offset[order]


def _lightest_first(sizes: np.ndarray, parts: int, loads: np.ndarray | None = None) -> np.ndarray:
    """The part each of ``sizes`` (in this order) goes to when each goes to the part with the
    fewest bytes so far (``loads`` at first: default none), the lowest part on a tie. Items of
    one size do not need the loop: part ``p`` offers them "slots" at loads ``L_p, L_p + s,
    L_p + 2s, ...``, and the lightest-first choices of a run of ``m`` such items are the ``m``
    smallest slots by (load, part): the merge of increasing sequences (property-tested against
    the loop)."""
    n = len(sizes)
    starts = np.flatnonzero(np.concatenate([[True], sizes[1:] != sizes[:-1]])) if n else np.zeros(0, dtype=np.int64)
    if len(starts) * 16 > n:  # many distinct sizes: one heap step per item
        start = [0] * parts if loads is None else loads.tolist()
        return np.array(lightest_first(sizes.tolist(), start), dtype=np.int64)
    loads = np.zeros(parts, dtype=np.int64) if loads is None else loads.astype(np.int64, copy=True)
    out = np.empty(n, dtype=np.int64)
    ids = np.arange(parts, dtype=np.int64)
    for a, b in zip(starts.tolist(), [*starts[1:].tolist(), n]):
        size, m = int(sizes[a]), b - a
        slots = loads[:, None] + size * np.arange(m, dtype=np.int64)  # (parts, m)
        owner = np.broadcast_to(ids[:, None], slots.shape)
        pick = np.lexsort((owner.ravel(), slots.ravel()))[:m]
        out[a:b] = owner.ravel()[pick]
        loads += np.bincount(out[a:b], minlength=parts) * size
    return out
