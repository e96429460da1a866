"""Small needs read as groups (``engine.read._group_small``): for random needs of a rank (small
tensors copied as bytes, others with callbacks or destinations, in two files, in file order or
not, some read through the shared page cache), the grouped needs serve every destination once,
and plan the same runs as the needs one by one: the same byte ranges read, the same units
verified, each run read through the cache exactly when it was."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.engine.load.reader import Need, _group_small
from unickpt.format.checksums import ChunkChecksums
from unickpt.planning.load.runs import Span, plan_runs

SETTINGS = settings(max_examples=examples(300), deadline=None, derandomize=True, database=None)
FILES = ("a", "b")


@st.composite
def needs(draw):
    """(needs, cached indices): byte ranges of two files, disjoint, mostly in file order."""
    out: list[Need] = []
    pos = {f: 0 for f in FILES}
    for i in range(draw(st.integers(0, 30))):
        f = draw(st.sampled_from(FILES))
        lo = pos[f] + draw(st.sampled_from([0, 0, 0, 8, 64, 4096, 4097, 10000]))
        hi = lo + draw(st.sampled_from([1, 7, 64, 4800, 300_000]))
        pos[f] = hi
        kind = draw(st.sampled_from(["into", "into", "into", "done", "dest"]))
        if kind == "into":
            out.append(Need(f, lo, hi, None, f"t{i}", None, ((lo, memoryview(bytearray(hi - lo))),)))
        else:
            out.append(Need(f, lo, hi, lambda b: None, f"t{i}", None))
    if draw(st.booleans()):
        out = draw(st.permutations(out))
    cached = {i for i in range(len(out)) if draw(st.booleans())} if draw(st.booleans()) else set()
    return out, cached


def _runs(wanted: list[Need], cached: set[int], chunk: int) -> list[tuple[int, int, int, bool, tuple[int, ...]]]:
    """(file, lo, hi, read through the cache, units) of every run the needs plan."""
    sums = ChunkChecksums.from_files(chunk, [(1 << 22, [0] * -(-(1 << 22) // chunk))] * 2)

    def cover(f: int, lo: int, hi: int) -> tuple[int, int]:
        u = sums.cover(f, lo, hi)
        return u.lo, u.hi

    spans = [Span(FILES.index(n.name), n.lo, n.hi, t) for t, n in enumerate(wanted)]
    return sorted(
        (r.file_index, r.lo, r.hi, any(t in cached for t in r.tags), sums.cover(r.file_index, r.lo, r.hi).starts)
        for r in plan_runs(spans, cover)
    )


@SETTINGS
@given(needs(), st.sampled_from([4096, 1 << 16, 1 << 20]))
def test_groups_plan_the_same_runs_and_serve_every_destination(case, chunk) -> None:
    wanted, cached = case
    grouped, grouped_cached = _group_small(wanted, cached)
    assert _runs(grouped, grouped_cached, chunk) == _runs(wanted, cached, chunk)
    served = [(at, len(into)) for n in grouped for at, into in n.into]
    assert sorted(served) == sorted((at, len(into)) for n in wanted for at, into in n.into)
    for n in grouped:  # a group holds its destinations, in one file, within its bytes
        assert all(n.lo <= at and at + len(into) <= n.hi for at, into in n.into)
    others = [n for n in wanted if not n.into]
    assert [n for n in grouped if not n.into] == others  # the same objects, in the same order
