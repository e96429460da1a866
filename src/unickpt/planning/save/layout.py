"""The byte layout rules of a save plan, written once (pure functions).

Each rank's items go into its files (parts) by one rule: in the order given (largest first),
each to the part holding the fewest bytes so far, the lowest part on a tie
(``lightest_first``); every entry starts at a multiple of ``ENTRY_ALIGN`` bytes (``padded``).
The planner's paths (``columns`` with ``split``, ``templates``) call these; ``layout_columns`` is
the same rule for one rank's items as numpy columns.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TypeVar

import numpy as np

from .model import ENTRY_ALIGN

__all__ = ["padded", "lightest_first", "largest_first", "place", "layout_columns"]

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


def place(sizes: list[int], loads: list[int], ends: list[int]) -> list[tuple[int, int]]:
    """(part, byte offset) of each item, in this order: ``lightest_first`` from ``loads``, each
    at its part's next aligned offset (``ends``: where each part's next entry starts)."""
    ends = list(ends)
    out = []
    for size, k in zip(sizes, lightest_first(sizes, loads)):
        out.append((k, ends[k]))
        ends[k] += padded(size)
    return out


def layout_columns(sizes: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``largest_first`` of one rank's items on columns: the entries' order (indices into
    ``sizes``, grouped by file, in the order the files got them), each one's part (file) and
    byte offset."""
    n = len(sizes)
    parts = min(parts, n)
    if parts <= 1:
        order = np.arange(n)
        part = np.zeros(n, dtype=np.int64)
    else:  # largest first (stable) to the lightest file
        by_size = np.argsort(-sizes, kind="stable")
        got = _lightest_first(sizes[by_size], parts)
        grouped = np.argsort(got, kind="stable")  # by file, each file's entries in assignment order
        order, part = by_size[grouped], got[grouped]
    aligned = padded(sizes[order])
    offset = np.cumsum(aligned) - aligned
    if parts > 1:  # every file starts at byte 0
        first = np.flatnonzero(np.concatenate([[True], part[1:] != part[:-1]]))
        offset -= np.repeat(offset[first], np.diff(np.append(first, n)))
    return order, part, offset


def _lightest_first(sizes: np.ndarray, parts: int) -> np.ndarray:
    """The part each of ``sizes`` (in this order) goes to when each goes to the part with the
    fewest bytes so far, the lowest part on a tie. Items of one size do not need the loop: part
    ``p`` offers them "slots" at loads ``L_p, L_p + s, L_p + 2s, ...``, and the lightest-first
    choices of a run of ``m`` such items are the ``m`` smallest slots by (load, part): the
    merge of increasing sequences (property-tested against the loop)."""
    n = len(sizes)
    starts = np.flatnonzero(np.concatenate([[True], sizes[1:] != sizes[:-1]])) if n else np.zeros(0, dtype=np.int64)
    if len(starts) * 16 > n:  # many distinct sizes: one heap step per item
        return np.array(lightest_first(sizes.tolist(), [0] * parts), dtype=np.int64)
    loads = np.zeros(parts, dtype=np.int64)
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
