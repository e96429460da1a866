"""The box math of the Megatron adapter (pure, no megatron needed): a flat range of a TP-local
tensor (the distributed optimizer's ``param`` range) maps to boxes of the global tensor that
cover exactly the range's elements, at the right flat positions, with prepended (stacked) axes
and clipped to the checkpoint's row count (padded vocabulary). Checked against numpy."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.frameworks.megatron import _Placement


@st.composite
def cases(draw):
    nd = draw(st.integers(1, 3))
    local = tuple(draw(st.lists(st.integers(1, 6), min_size=nd, max_size=nd)))
    prepend = draw(st.integers(0, 1))
    base = tuple(draw(st.integers(0, 5)) for _ in range(nd))
    lead = tuple(draw(st.integers(0, 3)) for _ in range(prepend))
    gshape = tuple(o + 1 for o in lead) + tuple(b + n + draw(st.integers(0, 3)) for b, n in zip(base, local))
    total = math.prod(local)
    start = draw(st.integers(0, total))
    numel = draw(st.integers(0, total - start))
    rows = None
    if prepend == 0 and draw(st.booleans()):
        rows = draw(st.integers(0, gshape[0] + 3))
    return local, prepend, lead + base, gshape, start, numel, rows


@settings(max_examples=examples(300), deadline=None)
@given(cases())
def test_boxes_cover_exactly_the_flat_range(case):
    local, prepend, offsets, gshape, start, numel, rows = case
    at = _Placement("t", gshape, offsets, prepend, local, rows)
    flat_index = np.arange(math.prod(local)).reshape(local)
    covered: list[int] = []
    for offs, lens, a, n in at.boxes(start, numel):
        assert n == math.prod(lens) > 0
        assert all(0 <= o and o + ln <= g for o, ln, g in zip(offs, lens, gshape)) or rows is not None
        assert offs[:prepend] == offsets[:prepend] and lens[:prepend] == (1,) * prepend
        # the box's elements, as flat indices of the local tensor, are start + a ... in order
        sl = tuple(slice(o - b, o - b + ln) for o, b, ln in zip(offs[prepend:], offsets[prepend:], lens[prepend:]))
        want = flat_index[sl].reshape(-1)
        assert want.tolist() == list(range(start + a, start + a + n))
        covered += want.tolist()
    expect = list(range(start, start + numel))
    if rows is not None:  # elements of local rows whose global row is past the checkpoint's end drop out
        expect = [i for i in expect if offsets[0] + i // math.prod(local[1:]) < rows]
    assert sorted(covered) == expect
