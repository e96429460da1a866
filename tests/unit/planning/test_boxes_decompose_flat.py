"""Flat ranges -> boxes, checked with real torch views (the way the FSDP1 adapter uses them).

1. ``decompose_flat_range``: the pieces of a random flat range of a random 1-D..4-D tensor are
   in order, tile the range exactly, and ``flat[a:b].view(lengths)`` (a zero-copy view) written
   into a zero global tensor at the boxes reproduces exactly that flat slice.
2. The FSDP1 per-parameter runs (``fsdp1.orig_param`` + ``fsdp1.local_pieces``) computed from
   torch's own ``FlatParamHandle._get_shard_metadata`` for random flat layouts (alignment
   padding included) and world sizes rebuild every original parameter from the ranks' padded
   local shards, element for element.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.errors import FrameworkError
from unickpt.frameworks.fsdp1 import local_pieces, orig_param
from unickpt.planning.boxes import decompose_flat_range, numel

SETTINGS = settings(max_examples=examples(150), deadline=None)
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)


@st.composite
def flat_ranges(draw):
    shape = draw(shapes)
    total = numel(shape)
    start = draw(st.integers(0, total))
    count = draw(st.integers(0, total - start))
    return shape, start, count


def _box(offsets, lengths):
    return tuple(slice(o, o + n) for o, n in zip(offsets, lengths))


@SETTINGS
@given(flat_ranges())
def test_views_reassemble_the_flat_slice(case):
    shape, start, count = case
    total = numel(shape)
    flat = torch.arange(1, total + 1, dtype=torch.float64)  # no zero: unwritten cells stay 0
    pieces = decompose_flat_range(shape, start, count)
    assert len(pieces) <= max(1, 2 * len(shape) - 1)
    pos = start
    out = torch.zeros(shape, dtype=flat.dtype)
    for pc in pieces:
        assert pc.flat_start == pos and pc.numel == numel(pc.lengths) > 0  # in order, no gap
        view = flat[pc.flat_start : pc.flat_start + pc.numel].view(pc.lengths)
        assert view.data_ptr() == flat[pc.flat_start :].data_ptr()  # a view, not a copy
        assert torch.equal(out[_box(pc.offsets, pc.lengths)], torch.zeros(pc.lengths, dtype=flat.dtype))
        out[_box(pc.offsets, pc.lengths)] = view
        pos += pc.numel
    assert pos == start + count
    expect = torch.zeros(total, dtype=flat.dtype)
    expect[start : start + count] = flat[start : start + count]
    assert torch.equal(out.reshape(-1), expect)


def test_zero_dim_and_empty_ranges():
    assert decompose_flat_range((), 0, 1)[0].lengths == ()
    assert decompose_flat_range((3, 4), 5, 0) == []
    assert local_pieces((3, 4), 5, 0) == []
    pcs = local_pieces((3, 4), 5, 4)  # row 1 cols 1..3, then row 2 col 0
    assert [(p.offsets, p.lengths, p.local_start) for p in pcs] == [((1, 1), (1, 3), 0), ((2, 0), (1, 1), 3)]


def _torch_shard_infos(numels_with_padding, is_padding, rank, world):
    """torch's own per-rank shard metadata for a flat layout (FlatParamHandle, no process group)."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    flat = SimpleNamespace(_numels_with_padding=tuple(numels_with_padding), _is_padding_mask=is_padding)
    fake = SimpleNamespace(flat_param=flat)
    fake._get_flat_param_offsets = lambda: FlatParamHandle._get_flat_param_offsets(fake)
    total = sum(numels_with_padding)
    size = -(-total // world)  # padded local shard size (torch.chunk + right padding)
    start, end = size * rank, size * (rank + 1) - 1
    return FlatParamHandle._get_shard_metadata(fake, start, end), size


@st.composite
def flat_layouts(draw):
    """Original param shapes interleaved with alignment padding entries, and a world size."""
    entries = draw(
        st.lists(
            st.one_of(shapes.map(lambda s: ("p", s)), st.integers(1, 3).map(lambda n: ("pad", n))),
            min_size=1,
            max_size=6,
        )
    )
    if all(kind == "pad" for kind, _ in entries):
        entries.append(("p", (5, 3)))
    return entries, draw(st.integers(1, 6))


@SETTINGS
@given(flat_layouts())
def test_fsdp1_runs_rebuild_every_param(layout):
    entries, world = layout
    numels = [numel(x) if kind == "p" else x for kind, x in entries]
    padding = [kind == "pad" for kind, _ in entries]
    shapes_ = [x for kind, x in entries if kind == "p"]
    total = sum(numels)
    unsharded = torch.arange(1, total + 1, dtype=torch.float64)
    params, pos = [], 0
    for n, pad in zip(numels, padding):
        if not pad:
            params.append(unsharded[pos : pos + n].view(shapes_[len(params)]))
        pos += n
    rebuilt = [torch.zeros(s, dtype=torch.float64) for s in shapes_]
    for rank in range(world):
        infos, size = _torch_shard_infos(numels, padding, rank, world)
        local = torch.zeros(size, dtype=torch.float64)  # the rank's padded shard
        chunk = unsharded[rank * size : (rank + 1) * size]
        local[: chunk.numel()] = chunk
        for i, (shape, info) in enumerate(zip(shapes_, infos)):
            op = orig_param(f"p{i}", shape, info, size)
            for pc in local_pieces(shape, op.param_start, op.numel):
                a = op.shard_offset + pc.local_start
                box = _box(pc.offsets, pc.lengths)
                assert not rebuilt[i][box].any(), "element saved twice"
                rebuilt[i][box] = local[a : a + pc.numel].view(pc.lengths)
    for p, r in zip(params, rebuilt):
        assert torch.equal(p, r)


def test_orig_param_rejects_inconsistent_info():
    info = SimpleNamespace(in_shard=True, offset_in_shard=8, numel_in_shard=4, intra_param_start_idx=0)
    with pytest.raises(FrameworkError, match="'w'"):
        orig_param("w", (2, 3), info, 10)
