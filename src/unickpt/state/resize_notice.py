"""Whether restoring per-rank state on more ranks than saved it makes ranks share values, and
the warning that names what they share.

After growing from ``n`` saved ranks under ``extra_state_on_resize="modulo"``, rank ``r``
restores saved rank ``r % n``'s value of a per-rank key (``extra_state``, a ``unickpt.PerRank``).
That is only worth a warning when the saved ranks' values differ (RNG states, per-rank
counters): values every rank saved alike (``{"step": 100}``) restore the same on every rank of
any size. ``state.items`` asks rank 0 to read every saved rank's blob of the key
(``peer_what``), and its ``apply`` calls ``shared_state_notice`` with them; the decision is a
pure function of the decoded values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..format.values import dumps_value

__all__ = ["PEER_PREFIX", "MAX_PEER_BYTES", "peer_what", "peer_values", "differing_parts", "shared_state_notice"]

PEER_PREFIX = "saved_rank."  # + saved rank: that rank's value, read on rank 0 to compare
# rank 0 reads the saved ranks' blobs to compare only up to this many bytes in all; above it
# the values are taken to differ (the warning names the key only)
MAX_PEER_BYTES = 16 << 20


def peer_what(saved_rank: int) -> str:
    """The ``what`` under which ``choose`` asks for saved rank ``saved_rank``'s blob."""
    return f"{PEER_PREFIX}{saved_rank}"


def peer_values(values: Mapping[str, Any]) -> list[Any]:
    """The saved ranks' values among an item's ``apply`` values, in saved-rank order."""
    found = {int(w[len(PEER_PREFIX) :]): v for w, v in values.items() if w.startswith(PEER_PREFIX)}
    return [found[r] for r in sorted(found)]


def _same(a: Any, b: Any) -> bool:
    try:
        return dumps_value(a) == dumps_value(b)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return False


def differing_parts(key: str, saved: Sequence[Any]) -> list[str]:
    """What differs between the saved ranks' values of ``key``: the dict entries
    (``extra_state['rng']``) when every value is a dict with the same keys, else ``key`` itself;
    empty when every rank saved the same value."""
    if len(saved) < 2 or all(_same(saved[0], v) for v in saved[1:]):
        return []
    first = saved[0]
    if isinstance(first, dict) and all(isinstance(v, dict) and v.keys() == first.keys() for v in saved):
        return [f"{key}[{k!r}]" for k in first if not all(_same(first[k], v[k]) for v in saved[1:])]
    return [key]


def shared_state_notice(key: str, saved: Sequence[Any], saved_world_size: int, unread: bool = False) -> str | None:
    """The warning for restoring ``key`` on more ranks than the ``saved_world_size`` that saved
    it, given the saved ranks' decoded values (``saved``); None when they are all alike. ``unread``:
    the values were too large to compare (``MAX_PEER_BYTES``): taken to differ."""
    parts = [key] if unread else differing_parts(key, saved)
    if not parts:
        return None
    what = ", ".join(parts)
    return (
        f"{what} differs between the {saved_world_size} ranks that saved it and this job has more ranks: "
        f"rank r restores saved rank r % {saved_world_size}'s, so ranks r and r + {saved_world_size} now share "
        f"the same {what} (LoadOptions(restore=RestoreOptions(extra_state_on_resize='rank0' | 'skip' | 'error')) "
        "to choose; or set these values per rank after the load)"
    )
