"""The byte layout of a save plan, written once (pure functions).

One rank's entries go into its files (parts) by one rule: its split chunks (``split``: tensors
every rank holds one ``torch.chunk`` of) first, each in its tensor's part, in the job's tensor
order, each at the next aligned offset (``stack``: where ``SplitLayout`` computes them); then its
other entries (``place_rest``) largest first, equal sizes in a given tie order, each to the part
holding the fewest bytes so far (split chunks counted), the lowest part on a tie, at that part's
next aligned offset; in a job without split tensors and one file, its entries in their order
(``lay_out_rank``). Every entry starts at a multiple of ``ENTRY_ALIGN`` bytes (``padded``).
``plan.plan_save`` places every rank's other entries at plan time; ``templates.RegularRankPlans``
stacks a rank's chunks when its plan is asked for; ``check_layout`` is the plan's self-check.
``largest_first`` gives the split tensors' parts (``split.split_parts``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np

from ...errors import InternalError
from ...format.validation import overlap_problems
from .model import ENTRY_ALIGN

__all__ = ["padded", "lightest_first", "largest_first", "stack", "place_rest", "lay_out_rank", "check_layout"]

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


def lay_out_rank(sizes: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The entries (``sizes``: their bytes) of a rank of a job without split tensors in its
    ``parts`` files: in one file, in their order; else largest first, equal sizes in their
    order, to the lightest part (``place_rest``). Returns the entries' order (indices into
    ``sizes``, grouped by part, each part in byte order), each one's part and byte offset."""
    n = len(sizes)
    if min(parts, n) <= 1:  # one file: the entries in their order
        aligned = padded(sizes)
        return np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.cumsum(aligned) - aligned
    zeros = np.zeros(parts, dtype=np.int64)
    order, part, offset = place_rest(sizes, np.arange(n, dtype=np.int64), zeros, zeros)
    by_part = np.argsort(part, kind="stable")
    return order[by_part], part[by_part], offset[by_part]


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


def check_layout(files: Sequence[str], columns: list[tuple[np.ndarray, ...]], owners: list[str]) -> None:
    """Self-check of a plan's byte layout (``plan.plan_save`` on every rank's entries placed at
    plan time, each rank's split chunks as one range per file): every file named once, no two
    ranges of a file overlap; ``columns``: (owner, file index, byte offset, byte length) arrays;
    a failure is a bug, ``InternalError``."""
    if not columns:  # no ranks
        return
    who, fidx, boff, blen = (np.concatenate([c[k] for c in columns]) for k in range(4))
    problems = overlap_problems(files, owners, who, fidx, boff, blen)
    if len(set(files)) != len(files):
        problems.insert(0, "two ranks were given the same data file")
    if problems:  # the layout above puts no two entries of a file together: a bug
        raise InternalError("the save plan's byte layout is inconsistent:\n  " + "\n  ".join(problems[:20]))
