"""The layout math of a Hugging Face export (``format.hf_layout``) and the writer assignment
(``engine.export.hf.assign``): headers per the safetensors spec (8-byte length, JSON, data
8-byte aligned, offsets back to back), every byte of every tensor covered by exactly one run of
exactly one box, refusals of overlapping or missing boxes. Oracles: ``json``, numpy slicing and
arithmetic on shapes, never the code under test."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.engine.export.hf import assign
from unickpt.errors import CheckpointError
from unickpt.format.hf_layout import HFExport, box_runs, index_json, plan_layout

_DTYPES = {torch.float32: ("F32", 4), torch.bfloat16: ("BF16", 2), torch.int64: ("I64", 8), torch.uint8: ("U8", 1)}
_shape = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
_tensors = st.lists(st.tuples(st.sampled_from(sorted(_DTYPES, key=str)), _shape), min_size=1, max_size=12).map(
    lambda ts: [(f"t{i}.weight", d, s) for i, (d, s) in enumerate(ts)]
)


@settings(max_examples=examples(150), deadline=None)
@given(_tensors, st.integers(1, 400))
def test_headers_follow_the_safetensors_spec_and_offsets_tile_each_file(tensors, max_shard) -> None:
    layout = plan_layout(tensors, max_shard)
    seen = []
    for f in layout.files:
        n = int.from_bytes(f.header[:8], "little")
        assert len(f.header) == 8 + n and n % 8 == 0  # the data starts 8-byte aligned
        header = json.loads(f.header[8:].decode())
        assert header.pop("__metadata__")["format"] == "pt"
        at = 0
        for name, entry in header.items():  # JSON order is file order: offsets back to back from 0
            dtype, shape = next((d, s) for nm, d, s in tensors if nm == name)
            code, size = _DTYPES[dtype]
            assert entry["dtype"] == code and entry["shape"] == list(shape)
            assert entry["data_offsets"] == [at, at + math.prod(shape) * size]
            assert f.tensors[name][0] == len(f.header) + at  # absolute offset in the file
            at += math.prod(shape) * size
            seen.append(name)
        assert f.size == len(f.header) + at
        assert at <= max_shard or len(header) == 1  # a larger tensor gets a file of its own
    assert seen == [name for name, _, _ in tensors]  # each once, in the given order
    assert layout.total_size == sum(math.prod(s) * _DTYPES[d][1] for _, d, s in tensors)
    names = [f.name for f in layout.files]
    if len(names) == 1:
        assert names == ["model.safetensors"]
    else:
        assert names == [f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)]
    index = json.loads(index_json(layout))
    assert index["metadata"]["total_size"] == layout.total_size
    assert index["weight_map"] == {n: f.name for f in layout.files for n in f.tensors}


@st.composite
def _tiling(draw):
    """A shape and a grid of boxes tiling it (each dim cut at random points)."""
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    cuts = []
    for n in shape:
        inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
        edges = [0, *inner, n]
        cuts.append([(a, b - a) for a, b in zip(edges, edges[1:])])
    boxes = [((), ())]
    for dim in cuts:
        boxes = [(o + (a,), ln + (n,)) for o, ln in boxes for a, n in dim]
    return tuple(shape), boxes, draw(st.sampled_from([1, 2, 4]))


@settings(max_examples=examples(200), deadline=None)
@given(_tiling())
def test_box_runs_cover_every_byte_once_in_the_box_row_major_order(case) -> None:
    shape, boxes, itemsize = case
    full = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)  # element i holds i
    covered = np.zeros(math.prod(shape) * itemsize, dtype=np.int64)
    for offsets, lengths in boxes:
        want = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].ravel()  # numpy's row-major box
        got = []
        for at, n in box_runs(shape, offsets, lengths, itemsize):
            assert at % itemsize == 0 and n % itemsize == 0 and n > 0
            covered[at : at + n] += 1
            got += list(range(at // itemsize, (at + n) // itemsize))
        assert got == want.tolist()
    assert (covered == 1).all()


def test_box_runs_of_a_dim0_shard_is_one_run_and_a_column_shard_one_per_row() -> None:
    assert list(box_runs((8, 4), (2, 0), (3, 4), 2)) == [(2 * 4 * 2, 3 * 4 * 2)]
    assert list(box_runs((3, 4), (0, 2), (3, 2), 1)) == [(2, 2), (6, 2), (10, 2)]
    assert list(box_runs((), (), (), 4)) == [(0, 4)]
    assert list(box_runs((3, 0), (0, 0), (3, 0), 4)) == []


def _desc(name, shape, boxes, dtype="float32", replica=None):
    return [[name, list(shape), dtype, list(o), list(n), replica, f"model.{name}"] for o, n in boxes]


def test_assign_gives_each_distinct_box_one_writer() -> None:
    rows = [((0, 0), (2, 4)), ((2, 0), (2, 4))]
    full = [((0, 0), (4, 4))]
    described = [
        _desc("a", (4, 4), rows[:1]) + _desc("b", (4, 4), full),
        _desc("a", (4, 4), rows[1:]) + _desc("b", (4, 4), full) + _desc("c", (3,), [((0,), (3,))], replica=1),
        _desc("c", (3,), [((0,), (3,))], replica=1),
    ]
    plan = assign([described[0], described[1][:2]], 2, None, 10**9)
    assert plan.writers == {("a", rows[0]): 0, ("a", rows[1]): 1, ("b", full[0]): 0}  # b: file 0's owner
    plan = assign([described[1][2:], described[2]], 2, torch.bfloat16, 10**9)
    assert plan.writers == {("c", ((0,), (3,))): 1}  # the replica source, not the file's owner
    assert plan.layout.files[0].tensors["c"][1] == torch.bfloat16


def test_assign_orders_tensors_as_the_checkpoint_then_by_first_appearance() -> None:
    described = [_desc("a", (2,), [((0,), (2,))]) + _desc("b", (2,), [((0,), (2,))]) + _desc("c", (1,), [((0,), (1,))])]
    assert list(assign(described, 1, None, 100).layout.files[0].tensors) == ["a", "b", "c"]
    plan = assign(described, 1, None, 100, order=["model.c", "model.a"])
    assert list(plan.layout.files[0].tensors) == ["c", "a", "b"]


def test_assign_refuses_overlaps_gaps_and_disagreement() -> None:
    with pytest.raises(CheckpointError, match="overlapping"):
        assign([_desc("a", (4,), [((0,), (3,))]), _desc("a", (4,), [((2,), (2,))])], 2, None, 100)
    with pytest.raises(CheckpointError, match="do not cover"):
        assign([_desc("a", (4,), [((0,), (2,))]), []], 2, None, 100)
    with pytest.raises(CheckpointError, match="disagree"):
        assign([_desc("a", (4,), [((0,), (2,))]), _desc("a", (4,), [((2,), (2,))], "float16")], 2, None, 100)


def test_options_refuse_unknown_dtype_and_bad_size() -> None:
    with pytest.raises(ValueError):
        HFExport(dtype="int3")
    with pytest.raises(ValueError):
        HFExport(max_shard_bytes=0)
