"""Who writes a replicated box, written once (pure functions).

A box several ranks hold is written once: by the replica a holder's spec names as its
``replica_source`` (``named_source``: the lowest named rank among the holders), else by the holder
with the fewest bytes assigned so far (``lightest_rank``: worst-fit, the boxes taken largest first
by the planners). Both paths of the planner (``columns``, ``templates``) choose writers with
these two rules, written once so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

__all__ = ["named_source", "lightest_rank"]


def named_source(sources: Iterable[int], holds: Callable[[int], bool]) -> int | None:
    """The lowest rank among ``sources`` (the holders' named replica sources; -1: none) that
    holds the box, or None to balance."""
    return next((s for s in sorted(set(sources) - {-1}) if holds(s)), None)


def lightest_rank(ranks: Sequence[int] | np.ndarray, load: Sequence[int] | np.ndarray) -> int:
    """The holder with the fewest bytes so far (``load`` by rank), the lowest rank on a tie
    (numpy ``ranks`` must be ascending)."""
    if isinstance(ranks, np.ndarray):
        return int(ranks[int(np.argmin(np.asarray(load)[ranks]))])
    return min(ranks, key=lambda r: (load[r], r))
