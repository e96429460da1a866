"""Who writes each box of a save, written once (pure functions).

A box several ranks hold is written once: by the replica a holder's spec names as its
``replica_source`` (``named_source``: the lowest named rank among the holders), else by the holder
with the fewest bytes assigned so far (``lightest_rank``: worst-fit, the boxes taken largest
first). ``choose_writers`` applies these rules to the boxes of a job given as rows of rank groups
(ranks with equal tables, ``templates.group_ranks``; one group per rank in an irregular job):
``plan.plan_save`` calls it after checking the ranks agree and before the split and byte layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

__all__ = ["named_source", "lightest_rank", "choose_writers"]


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


def choose_writers(
    names: Sequence[str],
    name: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    nbytes: np.ndarray,
    source: np.ndarray,
    group: np.ndarray,
    load: np.ndarray,
    group_ranks: Sequence[np.ndarray] | None = None,
    group_of: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The row that writes each distinct box and the rank writing it, for rows (one per box a
    group holds, skipped empty shards excluded; ``name`` indexes ``names``; ``offsets`` and
    ``lengths`` padded alike per tensor) in group order, then each group's row order.
    ``group``: each row's group; ``group_ranks``: each group's ranks, ascending (None: group g
    is rank g alone); ``group_of``: each rank's group; ``load``: each rank's bytes so far (a
    copy is updated). A box's holders are the ranks of the groups holding it. Each box is
    written by its only holder, else the replica source a holder names, else (largest first,
    then by (fqn, offsets, lengths)) the holder with the fewest bytes so far, the lowest rank on
    a tie. A group holding one box in two rows is one holder: as the named source its last row
    writes, as the balanced choice its first. Also each chosen box's place in the record order
    (what a refusal lists boxes in): its first holder's row for the fixed ones, after every row
    the balanced ones in turn."""
    load = np.asarray(load, dtype=np.int64).copy()
    world = len(load)
    if group_of is None:
        group_of = np.arange(world, dtype=np.int64)
    n = len(name)
    keys = np.column_stack([name, offsets, lengths])
    order = np.lexsort(keys.T[::-1])  # by tensor, offsets, lengths; stable: holders in group order
    ks = keys[order]
    starts = np.flatnonzero(np.concatenate([[True], (ks[1:] != ks[:-1]).any(axis=1)])) if n else np.zeros(0, np.int64)
    counts = np.diff(np.append(starts, n))
    one_row = order[starts[counts == 1]]
    if group_ranks is None:
        alone = np.ones(len(one_row), dtype=bool)
        rank_of_group = group
    else:
        sizes = np.array([len(g) for g in group_ranks], dtype=np.int64)
        alone = sizes[group[one_row]] == 1
        rank_of_group = np.array([int(g[0]) for g in group_ranks], dtype=np.int64)[group]
    unique = one_row[alone]
    np.add.at(load, rank_of_group[unique], nbytes[unique])
    shared_starts = np.concatenate([starts[counts > 1], starts[counts == 1][~alone]])
    shared_counts = np.concatenate([counts[counts > 1], np.ones(int((~alone).sum()), dtype=np.int64)])
    unique_ranks = rank_of_group[unique]
    if not len(shared_starts):
        return unique, unique_ranks, unique.copy()
    # the replicated boxes, in worst-fit order: bytes descending, then (fqn, offsets, lengths)
    heads = order[shared_starts]
    by_name = np.empty(len(names), dtype=np.int64)
    by_name[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
    # np.lexsort: the last key is the primary one; a box's dims compare first to last
    worst_first = np.lexsort(
        np.concatenate([lengths[heads].T[::-1], offsets[heads].T[::-1], [by_name[name[heads]], -nbytes[heads]]])
    )
    members = order.tolist()
    groups, sources, sizes_of = group.tolist(), source.tolist(), nbytes.tolist()
    heads_of = heads.tolist()
    starts_of, counts_of = shared_starts.tolist(), shared_counts.tolist()
    loads = load.tolist() if group_ranks is None else load  # Python ints per box, or one array per job
    fixed, fixed_ranks, fixed_heads, balanced = [], [], [], []
    for k in worst_first.tolist():
        rows = members[starts_of[k] : starts_of[k] + counts_of[k]]
        row_in = {groups[r]: r for r in rows}  # a group holding the box twice: its last row

        def holds(s: int, row_in: dict[int, int] = row_in) -> bool:
            return 0 <= s < world and int(group_of[s]) in row_in

        src = named_source((sources[r] for r in rows), holds)
        if src is not None:
            r = row_in[int(group_of[src])]
            fixed.append(r)
            fixed_ranks.append(src)
            fixed_heads.append(heads_of[k])
            loads[src] += sizes_of[r]
            continue
        if len(row_in) != len(rows):
            row_in = {groups[r]: r for r in reversed(rows)}  # its first row
        balanced.append(row_in)
    picks, pick_ranks = [], []
    for row_in in balanced:
        if group_ranks is None:
            rank = lightest_rank(list(row_in), loads)
        else:
            held = [group_ranks[g] for g in row_in]
            ranks = held[0] if len(held) == 1 else np.sort(np.concatenate(held))
            rank = lightest_rank(ranks, load) if len(ranks) > 1 else int(ranks[0])
        r = row_in[int(group_of[rank])]
        picks.append(r)
        pick_ranks.append(rank)
        loads[rank] += sizes_of[r]
    chosen = np.concatenate([unique, np.array(fixed + picks, dtype=np.int64)])
    ranks_out = np.concatenate([unique_ranks, np.array(fixed_ranks + pick_ranks, dtype=np.int64)])
    later = n + np.arange(len(picks), dtype=np.int64)
    return chosen, ranks_out, np.concatenate([unique, np.array(fixed_heads, dtype=np.int64), later])
