"""The shape of tree coordination: which ranks gather to which, level by level (pure functions).

Level 0 groups the ranks of one host (a run of consecutive ranks): its first rank is the host's
*leader*. Level 1 groups the leaders of ``fan_out`` consecutive level-0 groups, its first member
leading it; and so on until one group remains, led by rank 0 (the coordinator). Every group's
ranks, its members' whole subtrees included, are one contiguous range of ranks, so a gather that
concatenates its members' lists in member order delivers every rank's value in rank order, and a
scatter hands each member one slice of its list.

``CoordinationOptions`` says when the tree is used (a world size of at least
``tree_min_world_size``) and how it is shaped; fields left at None take their environment
defaults when unickpt's process groups are created (``resolved``). It also says how often a rank
waiting in a collective warns about the ranks that have not arrived (``wait_warning_s``,
``coordination.waits``; read when the ``Checkpointer`` is created).
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "CoordinationOptions",
    "TreeShape",
    "TreeGroup",
    "TreeLayout",
    "host_sizes",
    "TREE_MIN_WORLD_SIZE_ENV",
    "TREE_FAN_OUT_ENV",
    "RANKS_PER_HOST_ENV",
    "WAIT_WARNING_ENV",
    "DEFAULT_WAIT_WARNING_S",
]

TREE_MIN_WORLD_SIZE_ENV = "UNICKPT_TREE_MIN_WORLD_SIZE"
TREE_FAN_OUT_ENV = "UNICKPT_TREE_FAN_OUT"
RANKS_PER_HOST_ENV = "UNICKPT_RANKS_PER_HOST"
T = TypeVar("T")
DEFAULT_TREE_MIN_WORLD_SIZE = 512
DEFAULT_FAN_OUT = 16
WAIT_WARNING_ENV = "UNICKPT_WAIT_WARNING_S"
DEFAULT_WAIT_WARNING_S = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinationOptions:
    """How a ``Checkpointer``'s collectives are shaped (every rank must pass the same values).

    ``tree_min_world_size``: from this world size on, collectives run as a tree (None:
    ``$UNICKPT_TREE_MIN_WORLD_SIZE``, else 512; a value above the world size keeps them flat);
    ``fan_out``: leaders per group above the hosts (None: ``$UNICKPT_TREE_FAN_OUT``, else 16);
    ``ranks_per_host``: consecutive ranks per host (None: ``$UNICKPT_RANKS_PER_HOST``, else
    detected from the ranks' host names);
    ``wait_warning_s``: while a rank waits in one of unickpt's collectives (or its commit
    barrier), it logs a warning naming the ranks that have not arrived every this many seconds
    (None: ``$UNICKPT_WAIT_WARNING_S``, else 60; 0: never). The deadline is unchanged
    (``SaveOptions.timeout``); this one may differ between ranks."""

    tree_min_world_size: int | None = None
    fan_out: int | None = None
    ranks_per_host: int | None = None
    wait_warning_s: float | None = None

    def __post_init__(self) -> None:
        _check("tree_min_world_size", self.tree_min_world_size, 2)
        _check("fan_out", self.fan_out, 2)
        _check("ranks_per_host", self.ranks_per_host, 1)
        if self.wait_warning_s is not None and not _is_interval(self.wait_warning_s):
            raise ValueError(
                "CoordinationOptions.wait_warning_s must be a number of seconds >= 0 or None, "
                f"got {self.wait_warning_s!r}"
            )

    def wait_warning_interval(self) -> float | None:
        """Seconds between the warnings of a waiting rank (None: no warnings): the field, else
        ``$UNICKPT_WAIT_WARNING_S``, else ``DEFAULT_WAIT_WARNING_S``."""
        value = self.wait_warning_s
        if value is None:
            value = _from_env(WAIT_WARNING_ENV, float, _is_interval, "a number of seconds >= 0")
        if value is None:
            return DEFAULT_WAIT_WARNING_S
        return float(value) if value > 0 else None

    def resolved(self) -> TreeShape:
        """The shape now: each field, or its environment default."""
        min_world_size = _pick(self.tree_min_world_size, TREE_MIN_WORLD_SIZE_ENV, 2)
        fan_out = _pick(self.fan_out, TREE_FAN_OUT_ENV, 2)
        return TreeShape(
            DEFAULT_TREE_MIN_WORLD_SIZE if min_world_size is None else min_world_size,
            DEFAULT_FAN_OUT if fan_out is None else fan_out,
            _pick(self.ranks_per_host, RANKS_PER_HOST_ENV, 1),
        )


@dataclass(frozen=True, slots=True)
class TreeShape:
    """Resolved ``CoordinationOptions`` (``ranks_per_host`` None: detect from host names)."""

    min_world_size: int
    fan_out: int
    ranks_per_host: int | None

    def uses_tree(self, world_size: int) -> bool:
        return world_size > 1 and world_size >= self.min_world_size


def _check(name: str, value: int | None, low: int) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
        raise ValueError(f"CoordinationOptions.{name} must be an integer >= {low} or None, got {value!r}")


def _is_interval(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _pick(value: int | None, env: str, low: int) -> int | None:
    """``value``, else the integer in ``$env``, else None."""
    if value is not None:
        return value
    return _from_env(env, int, lambda v: v >= low, f"an integer >= {low}")


def _from_env(env: str, parse: Callable[[str], T], valid: Callable[[T], bool], rule: str) -> T | None:
    """The value of ``$env`` (None: unset or blank); ``ValueError`` saying ``rule`` if it is not one."""
    text = os.environ.get(env, "").strip()
    if not text:
        return None
    try:
        value = parse(text)
    except ValueError:
        raise ValueError(f"${env} must be {rule}, got {text!r}") from None
    if not valid(value):
        raise ValueError(f"${env} must be {rule}, got {text!r}")
    return value


def host_sizes(world_size: int, ranks_per_host: int | None = None, names: Sequence[str] | None = None) -> list[int]:
    """The sizes of the hosts, in rank order: blocks of ``ranks_per_host`` (the last may be
    smaller), else runs of consecutive ranks with the same host name (``names``, one per rank)."""
    if ranks_per_host is not None:
        full, rest = divmod(world_size, ranks_per_host)
        return [ranks_per_host] * full + ([rest] if rest else [])
    if names is None or len(names) != world_size:
        raise ValueError(f"host_sizes needs ranks_per_host or one host name per rank ({world_size})")
    sizes: list[int] = []
    for i, name in enumerate(names):
        if i > 0 and name == names[i - 1]:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


@dataclass(frozen=True, slots=True)
class TreeGroup:
    """One group of the tree: ``members`` (ascending; ``members[0]`` leads it), and the end of
    its ranks: member ``i`` stands for the ranks ``span(i)``, the group for
    ``range(members[0], end)``."""

    members: tuple[int, ...]
    end: int

    def span(self, i: int) -> tuple[int, int]:
        stop = self.members[i + 1] if i + 1 < len(self.members) else self.end
        return self.members[i], stop

    @property
    def leader(self) -> int:
        return self.members[0]


@dataclass(frozen=True, slots=True)
class TreeLayout:
    """Every group of every level (``levels[0]``: the hosts; the last level: one group, led by
    rank 0). Build it with ``TreeLayout.build``."""

    world_size: int
    fan_out: int
    levels: tuple[tuple[TreeGroup, ...], ...]

    @classmethod
    def build(cls, sizes: Sequence[int], fan_out: int) -> TreeLayout:
        """The tree over hosts of ``sizes`` ranks each (in rank order), ``fan_out`` leaders per
        group above them."""
        if fan_out < 2:
            raise ValueError(f"fan_out must be >= 2, got {fan_out}")
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"host sizes must be positive, got {list(sizes)}")
        level: list[TreeGroup] = []
        start = 0
        for s in sizes:
            level.append(TreeGroup(tuple(range(start, start + s)), start + s))
            start += s
        levels = [tuple(level)]
        while len(levels[-1]) > 1:
            below = levels[-1]
            chunks = [below[i : i + fan_out] for i in range(0, len(below), fan_out)]
            levels.append(tuple(TreeGroup(tuple(g.leader for g in c), c[-1].end) for c in chunks))
        return cls(start, fan_out, tuple(levels))

    def group_of(self, level: int, rank: int) -> TreeGroup:
        """The group of ``level`` whose ranks include ``rank``."""
        groups = self.levels[level]
        i = bisect.bisect_right([g.leader for g in groups], rank) - 1
        return groups[i]

    def path(self, rank: int) -> tuple[tuple[int, TreeGroup], ...]:
        """The (level, group) pairs ``rank`` is a member of, bottom-up: its host's group, then
        while it leads its group, the group one level up. It leads every group but the last
        (which it leads only as rank 0, the root)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not a rank of world size {self.world_size}")
        out = [(0, self.group_of(0, rank))]
        while out[-1][1].leader == rank and len(out) < len(self.levels):
            out.append((len(out), self.group_of(len(out), rank)))
        return tuple(out)

    def describe(self) -> str:
        """``8 ranks: 2 hosts (4 ranks each) -> 1 group (fan-out 2)``."""
        hosts = self.levels[0]
        sizes = sorted({len(g.members) for g in hosts})
        each = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        parts = [f"{len(hosts)} host(s) ({each} rank(s) each)"] + [f"{len(lv)} group(s)" for lv in self.levels[1:]]
        return f"{self.world_size} ranks: " + " -> ".join(parts) + f" (fan-out {self.fan_out})"
