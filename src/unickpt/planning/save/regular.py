"""Regular layouts in a save plan (pure functions): tensors every rank holds one ``torch.chunk``
of, rank r chunk r (FSDP's ``Shard(0)`` over the whole job, ZeRO-3), laid out alike in every
rank's files, so the metadata describes them once (``format.layouts.SplitLayout``) instead of
one row per rank.

Runs on the coordinator (``plan.plan_save``) after either planner chose the writer of every box
and laid out the bytes: ``regularize`` finds the split tensors among the writers, gives each one a
part (file) of every rank by its size alone (the same on every rank), and lays out each rank's
files again: the split tensors' chunks first, in the job's tensor order, each at the next 64-byte
boundary (exactly where ``SplitLayout`` computes them), then the rank's other entries (replicated
boxes it writes, irregular shards, blobs), largest first to the file with the fewest bytes. The
plan keeps every entry and its size; only files and offsets move, and the plan records the layouts
(``GlobalSavePlan.layouts``) for the commit's metadata.

A tensor is split when it has at least one dimension, some elements, and every rank whose
chunk is not empty writes exactly that chunk along one dimension (chunk r of ``world`` parts,
``torch.chunk``'s rule, the other dimensions whole); ranks past the last non-empty chunk (fewer
rows than ranks, or ``torch.chunk``'s short tail: a 128,256-row vocabulary over 4,096 ranks
fills 4,008 chunks) write nothing of it, and its layout says so (empty parts take no bytes).
If that would leave a rank without a file the layout names, only tensors without empty chunks
are split. Anything else stays as rows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import numpy as np

from ...errors import PlanningError
from ...format.dtypes import itemsize
from ...format.layouts import chunk_rows
from ...format.validation import overlap_problems
from .layout import largest_first, padded, place
from .model import GlobalSavePlan, RankSavePlan, WriteEntry, file_name

__all__ = ["regularize", "split_tensors"]

Shape = tuple[int, ...]


def split_tensors(gplan: GlobalSavePlan) -> dict[str, int]:
    """The tensors of ``gplan`` whose ``torch.chunk`` parts over the ranks are written by their
    ranks, rank r chunk r, each non-empty chunk once (empty ones by nobody): fqn -> the dimension
    they are split along (in the plan's tensor order)."""
    world = len(gplan.rank_plans)
    boxes: dict[str, list[tuple[Shape, Shape, int]]] = defaultdict(list)
    for fqn, offs, lens, rank, _ in gplan.writers:
        boxes[fqn].append((offs, lens, rank))
    out = {}
    chunks: dict[tuple[Shape, int], list[tuple[Shape, Shape, int]]] = {}
    for fqn, (_, shape) in gplan.tensors.items():
        found = boxes.get(fqn, [])
        if not shape or math.prod(shape) == 0 or not found:
            continue
        offs, lens, _ = found[0]
        cut = [i for i, (o, n, s) in enumerate(zip(offs, lens, shape)) if o != 0 or n != s]
        d = cut[0] if len(cut) == 1 else -1
        if d < 0:
            continue
        want = chunks.get((shape, d))
        if want is None:  # many tensors share a shape: their chunk boxes are built once
            want = chunks[(shape, d)] = _chunk_boxes(shape, d, world)
        # one box per non-empty chunk, rank r's chunk r (compared as whole lists: C speed)
        if len(found) == len(want) and (found == want or sorted(found, key=_by_rank) == want):
            out[fqn] = d
    return out


def _chunk_boxes(shape: Shape, d: int, world: int) -> list[tuple[Shape, Shape, int]]:
    """``(offsets, lengths, rank)`` of every non-empty ``torch.chunk`` part of ``shape`` along
    ``d`` over ``world`` ranks, rank order."""
    out = []
    for r in range(world):
        lo, n = chunk_rows(shape[d], world, r)
        if not n:
            break
        offs, lens = [0] * len(shape), list(shape)
        offs[d], lens[d] = lo, n
        out.append((tuple(offs), tuple(lens), r))
    return out


def _by_rank(box: tuple[Shape, Shape, int]) -> int:
    return box[2]


def _full(gplan: GlobalSavePlan, split: dict[str, int]) -> dict[str, int]:
    """The split tensors whose every chunk has rows."""
    world = len(gplan.rank_plans)
    return {f: d for f, d in split.items() if chunk_rows(gplan.tensors[f][1][d], world, world - 1)[1]}


def regularize(gplan: GlobalSavePlan, files_per_rank: int) -> GlobalSavePlan:
    """``gplan`` with its split tensors laid out alike in every rank's files (module docstring)
    and those layouts recorded; ``gplan`` itself when it has none (one rank, or no split
    tensor)."""
    world = len(gplan.rank_plans)
    split = split_tensors(gplan) if world > 1 else {}
    if not split:
        return gplan
    try:
        out = _laid_out(gplan, split, files_per_rank)
    except _RankWithoutFile:  # keep the tensors with empty chunks as rows
        split = _full(gplan, split)
        try:
            out = _laid_out(gplan, split, files_per_rank) if split else gplan
        except _RankWithoutFile:
            out = gplan
    if out is not gplan:
        _check(out)
    return out


class _RankWithoutFile(Exception):
    """A layout part would name a file its rank does not write (the rank holds only empty
    chunks of that part's tensors and nothing else there): ``regularize`` then lays out fewer
    tensors, or none."""


def _laid_out(gplan: GlobalSavePlan, split: dict[str, int], files_per_rank: int) -> GlobalSavePlan:
    world = len(gplan.rank_plans)
    parts = max(1, files_per_rank)
    part_of = _parts(gplan, split, parts, world)
    item_of = {(rank, fqn): idx for fqn, _, _, rank, idx in gplan.writers if fqn in split}
    order = [fqn for fqn in gplan.tensors if fqn in split]  # the job's tensor order
    per_part = [[fqn for fqn in order if part_of[fqn] == k] for k in range(parts)]
    rank_plans = []
    files: list[str] = []
    for rp in gplan.rank_plans:
        entries = _rank_layout(gplan, rp, per_part, item_of, split, parts)
        rank_plans.append(RankSavePlan(rp.rank, gplan.save_id, entries))
        files.extend(dict.fromkeys(e.file for e in entries))
    index = {f: i for i, f in enumerate(files)}
    used = [k for k in range(parts) if per_part[k]]
    if any(file_name(r, k) not in index for r in range(world) for k in used):
        raise _RankWithoutFile
    layouts = tuple(
        (
            tuple(index[file_name(r, k)] for r in range(world)),
            tuple((fqn, split[fqn]) for fqn in per_part[k]),
        )
        for k in range(parts)
        if per_part[k]
    )
    writers = tuple(w for w in gplan.writers if w[0] not in split)  # the layouts describe the rest
    return replace(gplan, rank_plans=tuple(rank_plans), files=tuple(files), writers=writers, layouts=layouts)


def _parts(gplan: GlobalSavePlan, split: dict[str, int], parts: int, world: int) -> dict[str, int]:
    """Each split tensor's part (file) on every rank: largest chunk first to the part with the
    fewest bytes, by the sizes of chunk 0 (the same decision on every rank)."""
    size = {}
    for fqn, d in split.items():
        dtype, shape = gplan.tensors[fqn]
        size[fqn] = chunk_rows(shape[d], world, 0)[1] * (math.prod(shape) // shape[d]) * itemsize(dtype)
    return dict(zip(split, largest_first([size[f] for f in split], parts)))  # ties: the tensor order


def _rank_layout(
    gplan: GlobalSavePlan,
    rp: RankSavePlan,
    per_part: list[list[str]],
    item_of: dict[tuple[int, str], int],
    split: dict[str, int],
    parts: int,
) -> tuple[WriteEntry, ...]:
    """One rank's entries: its chunk of each split tensor first in each part, in order, then
    its other entries, largest first to the lightest part."""
    sizes = {e.item_index: e.byte_length for e in rp.entries if not e.blob_key}
    placed: list[list[WriteEntry]] = [[] for _ in range(parts)]
    ends = [0] * parts  # where each part's next entry starts (aligned)
    loads = [0] * parts  # the bytes each part holds (what the lightest part is chosen by)
    mine = set()
    for k, names in enumerate(per_part):
        name = file_name(rp.rank, k)
        for fqn in names:
            idx = item_of.get((rp.rank, fqn))
            if idx is None:  # an empty chunk: no bytes here (its layout part is empty too)
                continue
            mine.add(idx)
            placed[k].append(WriteEntry(idx, name, ends[k], sizes[idx]))
            ends[k] += padded(sizes[idx])
            loads[k] += sizes[idx]
    rest = sorted((e for e in rp.entries if e.blob_key or e.item_index not in mine), key=_rest_order)
    for e, (k, off) in zip(rest, place([e.byte_length for e in rest], loads, ends)):
        placed[k].append(WriteEntry(e.item_index, file_name(rp.rank, k), off, e.byte_length, e.blob_key))
    return tuple(e for k in range(parts) for e in placed[k])


def _rest_order(e: WriteEntry) -> tuple[int, bool, int, str]:
    """Largest first; among equal sizes tensors by item, then blobs by key (what
    ``templates`` places alike without the entries' earlier order)."""
    return -e.byte_length, bool(e.blob_key), e.item_index if not e.blob_key else 0, e.blob_key


def _check(gplan: GlobalSavePlan) -> None:
    """No two entries of a file overlap (the decoder's check, before anything is written)."""
    index = {f: i for i, f in enumerate(gplan.files)}
    rows = [(index[e.file], e.byte_offset, e.byte_length) for rp in gplan.rank_plans for e in rp.entries]
    if not rows:
        return
    a = np.array(rows, dtype=np.int64)
    problems = overlap_problems(gplan.files, ["entry"], np.zeros(len(a), dtype=np.int64), a[:, 0], a[:, 1], a[:, 2])
    if len(index) != len(gplan.files) or problems:
        raise PlanningError("the regular layout of the save plan is inconsistent:\n  " + "\n  ".join(problems[:20]))
