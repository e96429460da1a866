"""The read math of the scale issue ("read only what is needed"), property-tested against plain
oracles: which rows of a saved box copies touch, how spans become runs, how checksum chunks
cover byte ranges, and that chunk checksums are CRC32C of each chunk."""

from __future__ import annotations

import math

import crc32c
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.format.checksums import ChunkChecksums, RangeChecksums, chunk_crcs
from unickpt.planning.load.runs import Span, needed_rows, plan_runs, row_bytes

SETTINGS = settings(max_examples=examples(300), deadline=None, derandomize=True, database=None)


@st.composite
def box_and_copies(draw):
    lengths = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    copies = []
    for _ in range(draw(st.integers(0, 3))):
        offs = tuple(draw(st.integers(0, n)) for n in lengths)
        lens = tuple(draw(st.integers(0, n - o)) for n, o in zip(lengths, offs))
        copies.append((offs, lens))
    return lengths, copies


@SETTINGS
@given(box_and_copies())
def test_needed_rows_are_the_rows_holding_every_copied_element(case) -> None:
    lengths, copies = case
    r0, r1 = needed_rows(lengths, copies)
    if not lengths:
        assert (r0, r1) == (0, 1)
        return
    touched = np.zeros(lengths, dtype=bool)
    for offs, lens in copies:
        touched[tuple(slice(o, o + n) for o, n in zip(offs, lens))] = True
    rows = np.flatnonzero(touched.reshape(lengths[0], -1).any(axis=1)) if lengths[0] else []
    if len(rows) == 0:
        assert r1 <= r0
    else:  # the smallest row range holding every copied element
        assert (r0, r1) == (int(rows[0]), int(rows[-1]) + 1)
    assert row_bytes(lengths, 4) == 4 * math.prod(lengths[1:])


@st.composite
def spans_and_chunks(draw):
    chunk = draw(st.sampled_from([1, 4, 16, 64]))
    files = draw(st.integers(1, 3))
    spans = []
    for f in range(files):
        pos = 0
        for _ in range(draw(st.integers(0, 6))):
            pos += draw(st.integers(0, 40))
            n = draw(st.integers(0, 50))
            spans.append(Span(f, pos, pos + n, len(spans)))
            pos += n
    gap = draw(st.sampled_from([0, 8, 4096]))
    return chunk, spans, gap


@SETTINGS
@given(spans_and_chunks())
def test_runs_serve_every_span_once_and_never_share_a_chunk(case) -> None:
    chunk, spans, gap = case

    def cover(f: int, lo: int, hi: int) -> tuple[int, int]:
        return lo // chunk * chunk, -(-hi // chunk) * chunk

    runs = plan_runs(spans, cover, gap)
    served = sorted(t for r in runs for t in r.tags)
    assert served == list(range(len(spans)))
    by_tag = {s.tag: s for s in spans}
    for r in runs:
        for t in r.tags:
            s = by_tag[t]
            assert s.file_index == r.file_index
            if s.hi > s.lo:  # the run reads the span's whole cover
                lo, hi = cover(s.file_index, s.lo, s.hi)
                assert r.lo <= lo and hi <= r.hi
    for f in {r.file_index for r in runs}:
        mine = sorted((r.lo, r.hi) for r in runs if r.file_index == f and r.hi > r.lo)
        for (_, a_hi), (b_lo, _) in zip(mine, mine[1:]):
            assert a_hi <= b_lo  # no byte (so no chunk) read by two runs


@SETTINGS
@given(st.binary(max_size=600), st.sampled_from([1, 7, 64, 256]), st.lists(st.integers(0, 600), max_size=5))
def test_chunk_crcs_are_the_crc_of_each_chunk_whatever_the_parts(data: bytes, chunk: int, cuts: list[int]) -> None:
    bounds = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    parts = [memoryview(data)[a:b] for a, b in zip(bounds, bounds[1:])]
    want = [crc32c.crc32c(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    assert chunk_crcs(parts, chunk) == want


@SETTINGS
@given(st.lists(st.integers(0, 300), min_size=1, max_size=4), st.sampled_from([16, 64]), st.data())
def test_chunk_cover_is_the_chunks_overlapping_a_range(sizes: list[int], chunk: int, data) -> None:
    crcs = [[(f << 16) + k for k in range(-(-n // chunk))] for f, n in enumerate(sizes)]
    sums = ChunkChecksums.from_files(chunk, list(zip(sizes, crcs)))
    f = data.draw(st.integers(0, len(sizes) - 1))
    lo = data.draw(st.integers(0, sizes[f]))
    hi = data.draw(st.integers(lo, sizes[f]))
    units = sums.cover(f, lo, hi)
    want = [k for k in range(len(crcs[f])) if k * chunk < hi and lo < min((k + 1) * chunk, sizes[f]) and lo < hi]
    assert list(units.crcs) == [crcs[f][k] for k in want]
    assert list(units.starts) == [k * chunk for k in want]
    assert list(units.ends) == [min((k + 1) * chunk, sizes[f]) for k in want]
    if want:
        assert units.lo <= lo and hi <= units.hi
        assert sums.extent(f, lo, hi) == (want[0] * chunk, min((want[-1] + 1) * chunk, sizes[f]))
    else:
        assert sums.extent(f, lo, hi) == (lo, hi)
    assert sums.extent(f, lo, hi) == (units.lo, units.hi)  # what read assignments compare
    assert sums.file_crcs(f) == crcs[f]
    assert sums.problems() == [f"checksum chunk size {chunk} is not in [4096, 1073741824]"]  # too small to save


def test_range_cover_is_the_units_overlapping_a_range() -> None:
    sums = RangeChecksums(((0, 0, 10, 1), (0, 64, 0, 2), (0, 64, 30, 3), (1, 0, 5, 4)))
    assert sums.cover(0, 5, 70).crcs == (1, 3)  # the empty unit at 64 holds no byte
    assert (sums.cover(0, 5, 70).lo, sums.cover(0, 5, 70).hi) == (0, 94)
    assert sums.cover(0, 10, 64).crcs == ()  # padding between units: nothing to verify
    assert sums.cover(1, 0, 5).crcs == (4,) and sums.crc_of(0, 64, 30) == 3
