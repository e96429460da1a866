"""planning.load.overlap.plan_local_load against a plain oracle: every (target, saved shard) pair
intersected by hand. Checkpoints mix tensors of a regular layout (``SplitShards``, where a target
that is exactly one part takes the planner's shortcut), tensors of shard rows (row splits, one
whole shard, 0-d) and targets of the saving layout, of another world size, random and empty;
the reads (their order, copies, shard records, rows and row bytes) are the oracle's."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.format.layouts import SplitLayout, SplitShards
from unickpt.format.records import Metadata, ShardRecord, TensorRecord, Topology
from unickpt.planning.load.overlap import CopyOp, ShardRead, plan_local_load, shard_read
from unickpt.planning.specs import ShardSpec

SETTINGS = settings(max_examples=examples(200), deadline=None, derandomize=True, database=None)
_DTYPES = {1: "uint8", 2: "bfloat16", 4: "float32"}


def _chunk(n: int, parts: int, p: int) -> tuple[int, int]:
    c = -(-n // parts)
    lo = min(n, p * c)
    return lo, min(n, lo + c) - lo


def _split_box(shape: tuple[int, ...], d: int, parts: int, p: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lo, n = _chunk(shape[d], parts, p)
    return tuple(lo if i == d else 0 for i in range(len(shape))), tuple(n if i == d else s for i, s in enumerate(shape))


@st.composite
def checkpoints(draw):
    """(metadata, parts, {fqn: split dim or None}) of a job of ``parts`` ranks."""
    parts = draw(st.integers(1, 5))
    entries, tensors, dims = [], {}, {}
    for i in range(draw(st.integers(0, 4))):  # tensors of one regular layout (files 0..parts-1)
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
        d = draw(st.integers(0, len(shape) - 1))
        entries.append((f"s{i}", draw(st.sampled_from([1, 2, 4])), shape, d))
        dims[f"s{i}"] = d
    if entries:
        lay = SplitLayout(tuple(range(parts)), tuple(entries))
        for e, (fqn, isz, shape, _) in enumerate(entries):
            tensors[fqn] = TensorRecord(fqn, _DTYPES[isz], shape, SplitShards(lay, e))
    pos = 0
    for i in range(draw(st.integers(0, 4))):  # tensors of shard rows, in file `parts`
        kind = draw(st.sampled_from(["rows", "whole", "scalar"]))
        shape = () if kind == "scalar" else tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        isz = draw(st.sampled_from([1, 2, 4]))
        if kind == "rows":
            boxes = [_split_box(shape, 0, parts, p) for p in range(parts)]
            boxes = [b for b in boxes if math.prod(b[1]) > 0]
        else:
            boxes = [((0,) * len(shape), shape)]
        shards = []
        for offs, lens in boxes:
            n = math.prod(lens) * isz
            shards.append(ShardRecord(offs, lens, parts, pos, n))
            pos += n
        tensors[f"t{i}"] = TensorRecord(f"t{i}", _DTYPES[isz], shape, tuple(shards))
        dims[f"t{i}"] = 0 if kind == "rows" else None
    files = tuple(f"f{i}" for i in range(parts + 1))
    return Metadata(3, "x", 0.0, Topology("t", parts), files, tensors), parts, dims


@st.composite
def targets(draw, md: Metadata, parts: int, dims: dict):
    """Targets of every tensor (some twice, some left out): the saving job's box of one rank,
    another world size's, the whole tensor, a random box inside the shape (maybe empty)."""
    specs = []
    for fqn, rec in md.tensors.items():
        for _ in range(draw(st.integers(0, 2))):
            shape, d = tuple(rec.shape), dims[fqn]
            kind = draw(st.sampled_from(["same", "same", "other world", "whole", "random"]))
            if not shape or kind == "whole" or (d is None and kind != "random"):
                offs, lens = (0,) * len(shape), shape
            elif kind in ("same", "other world"):
                world = parts if kind == "same" else draw(st.integers(1, 6))
                offs, lens = _split_box(shape, d if d is not None else 0, world, draw(st.integers(0, world - 1)))
            else:
                offs = tuple(draw(st.integers(0, s)) for s in shape)
                lens = tuple(draw(st.integers(0, s - o)) for s, o in zip(shape, offs))
            specs.append(ShardSpec(fqn, rec.dtype, shape, offs, lens))
    return draw(st.permutations(specs))


def _oracle(md: Metadata, specs: list[ShardSpec]) -> list[ShardRead]:
    """Every target against every saved shard, by hand; reads in order of their first copy,
    then stably sorted by (file, offset)."""
    found: dict[tuple[str, int], list[CopyOp]] = {}
    for idx, spec in enumerate(specs):
        rec = md.tensors[spec.fqn]
        for i, shard in enumerate(list(rec.shards)):
            lo = [max(a, b) for a, b in zip(spec.offsets, shard.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(spec.offsets, spec.lengths, shard.offsets, shard.lengths)]
            if math.prod(spec.lengths) == 0 or any(h <= low for low, h in zip(lo, hi)):
                continue
            lens = tuple(h - low for low, h in zip(lo, hi))
            src = tuple(a - b for a, b in zip(lo, shard.offsets))
            dst = tuple(a - b for a, b in zip(lo, spec.offsets))
            found.setdefault((spec.fqn, i), []).append(CopyOp(idx, src, dst, lens))
    out = []
    for (fqn, i), ops in found.items():
        rec = md.tensors[fqn]
        shard = rec.shards[i]
        isz = {"uint8": 1, "bfloat16": 2, "float32": 4}[rec.dtype]
        lengths = shard.lengths
        if lengths:
            rows = (min(c.src_offsets[0] for c in ops), max(c.src_offsets[0] + c.lengths[0] for c in ops))
            row_bytes = math.prod(lengths[1:]) * isz
        else:  # a 0-d shard is one row of one element
            rows, row_bytes = (0, 1), isz
        out.append(ShardRead(fqn, i, tuple(ops), shard, row_bytes, rows))
    out.sort(key=lambda r: (r.shard.file_index, r.shard.byte_offset))
    return out


@SETTINGS
@given(checkpoints(), st.data())
def test_plan_is_every_pair_intersected(ckpt, data) -> None:
    md, parts, dims = ckpt
    specs = data.draw(targets(md, parts, dims))
    assert plan_local_load(md, specs) == _oracle(md, specs)


@SETTINGS
@given(st.lists(st.integers(0, 6), min_size=0, max_size=3), st.data())
def test_shard_read_rows_are_the_rows_its_copies_touch(shape, data) -> None:
    """``shard_read``'s shortcut (one copy of a whole non-empty shard) and its general case
    give the rows a plain scan of the copies touches."""
    shape = tuple(shape)
    shard = ShardRecord((0,) * len(shape), shape, 0, 0, math.prod(shape) * 4)
    copies = []
    for _ in range(data.draw(st.integers(1, 3))):
        offs = tuple(data.draw(st.integers(0, s)) for s in shape)
        lens = tuple(data.draw(st.integers(0, s - o)) for s, o in zip(shape, offs))
        copies.append(CopyOp(0, offs, (0,) * len(shape), lens))
    if data.draw(st.booleans()):
        copies = [CopyOp(0, (0,) * len(shape), (0,) * len(shape), shape)]
    got = shard_read("w", 0, shard, 4, tuple(copies))
    if not shape:
        want = (0, 1)
    else:
        touched = [(c.src_offsets[0], c.src_offsets[0] + c.lengths[0]) for c in copies if math.prod(c.lengths) > 0]
        want = (min(a for a, _ in touched), max(b for _, b in touched)) if touched else (0, 0)
    assert got.rows == want
    assert got.row_bytes == (math.prod(shape[1:]) * 4 if shape else 4)
