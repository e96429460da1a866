"""The needs exchange of a distributed load (``engine.load.exchange``): the coordinator's
per-rank parts are the job's read assignment split by rank, each rank's part holds only the
batches it reads or receives (a received batch names only that rank), a rank's part does not
grow with the job, shards needed in disjoint rows stay with their ranks, and one host over a
shared page cache forwards nothing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.read_fixtures import one_file_metadata as _md
from tests.support.hypothesis_profiles import examples
from unickpt.engine.load import exchange as load_exchange
from unickpt.format.records import Metadata
from unickpt.planning.load.assign import ReadPart, decode_part, own_keys, plain_batches, plain_disjoint, report_needs
from unickpt.planning.load.runs import vectorized


def _exact(f: int, lo: int, hi: int) -> tuple[int, int]:
    return lo, hi


def _report(md: Metadata, needs: list[dict[str, tuple[int, int]]], host=lambda r: "h") -> list:
    """What each rank sends: its host and its needs (shard 0 of each tensor, rows)."""
    return [(host(r), {(fqn, 0): rows for fqn, rows in n.items()}) for r, n in enumerate(needs)]


def read_parts(md: Metadata, reports: list, dedup, page_cache, extent) -> list[ReadPart]:
    """The coordinator's parts as each rank decodes them (through the wire form)."""
    names = list(md.tensors)
    gathered = [(h, report_needs(md, rows, names)) for h, rows in reports]
    wires = load_exchange.read_parts(md, gathered, dedup, page_cache, vectorized(extent))
    return [decode_part(w, names, list(rows), r) for r, (w, (_, rows)) in enumerate(zip(wires, reports))]


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=12), st.integers(2, 6), st.data())
def test_parts_are_the_jobs_assignment_split_by_rank(sizes, world, data):
    md = _md(sizes)
    needs = []
    for _ in range(world):
        n = {}
        for i, size in enumerate(sizes):
            if data.draw(st.booleans()):
                whole = data.draw(st.booleans())
                n[f"t{i}"] = (
                    (0, size) if whole else sorted(data.draw(st.tuples(st.integers(0, size), st.integers(0, size))))
                )
        needs.append({k: tuple(v) for k, v in n.items()})
    parts = read_parts(md, _report(md, needs), True, True, _exact)
    assert len(parts) == world and all(isinstance(p, ReadPart) and p.batches is not None for p in parts)
    # the reference: the assignment every rank computed alone before, from every rank's needs
    by_rank = [{(f, 0): r for f, r in n.items()} for n in needs]
    apart = plain_disjoint(md, by_rank, _exact)
    job_needs = [[k for k in n if k not in apart] for n in by_rank]
    job = plain_batches(md, job_needs, cover=_exact)  # no checksum chunks: every shard its own segment
    want_reader = {k: b.reader for b in job for k in b.keys}
    shared = {k for k in want_reader if sum(k in n for n in by_rank) > 1}
    for r, p in enumerate(parts):
        assert p.apart == frozenset(k for k in by_rank[r] if k in apart)
        for b in p.batches:
            assert set(b.keys) <= shared  # only shards several ranks need
            assert b.reader == r or b.consumers == (r,)  # a receiver's copy names only itself
            for k in b.keys:
                assert b.reader == want_reader[k]  # the reader an assignment of every need picks
        if any(b.reader == r for b in p.batches):  # a reader sends to every consumer
            for b in (b for b in p.batches if b.reader == r):
                assert set(b.consumers) == {c for c, n in enumerate(by_rank) if b.keys[0] in n}
        # every shard this rank needs, exactly once: received/read shared, own rows, or alone
        own = own_keys(r, list(by_rank[r]), p)
        assert own == [k for k in by_rank[r] if k not in shared and k not in apart]  # in the rank's order
        got = [k for b in p.batches if r in b.consumers for k in b.keys] + own
        got += list(p.apart)
        assert sorted(got) == sorted(by_rank[r])


def test_a_ranks_part_does_not_grow_with_the_job():
    """Every rank needs every tensor whole (replicated state): a rank that receives a batch gets
    it naming itself alone, at 16 ranks as at 64; readers are spread over the job."""
    md = _md([1000] * 8)
    everyone = {f"t{i}": (0, 1000) for i in range(8)}
    sizes = {}
    for world in (16, 64):
        parts = read_parts(md, _report(md, [everyone] * world), True, True, _exact)
        receiver = next(p for r, p in enumerate(parts) if all(b.reader != r for b in p.batches))
        assert all(b.consumers == (parts.index(receiver),) for b in receiver.batches)
        sizes[world] = (len(receiver.batches), sum(len(b.keys) for b in receiver.batches))
        readers = {b.reader for p in parts for b in p.batches}
        assert len(readers) == 8
    # each tensor received once, whatever the world size
    assert sizes[16] == sizes[64] == (8, 8)


def test_one_host_over_a_shared_page_cache_forwards_nothing():
    md = _md([500, 700, 900])
    needs = [{"t0": (0, 500), "t1": (0, 700)}, {"t1": (0, 700), "t2": (0, 900)}, {"t2": (0, 900)}]
    parts = read_parts(md, _report(md, needs), None, True, _exact)
    assert [p.batches for p in parts] == [None, None, None]
    assert [p.shared for p in parts] == [
        frozenset({("t1", 0)}),
        frozenset({("t1", 0), ("t2", 0)}),
        frozenset({("t2", 0)}),
    ]
    # two hosts (or storage without a shared cache): forwarded after all
    two_hosts = read_parts(md, _report(md, needs, host=lambda r: f"h{r % 2}"), None, True, _exact)
    assert all(p.batches is not None for p in two_hosts)
    assert any(b.forwarded for p in two_hosts for b in p.batches)
    assert all(p.batches is not None for p in read_parts(md, _report(md, needs), None, False, _exact))


def test_disjoint_rows_stay_with_their_ranks():
    """A 4 MiB shard two ranks need in halves: each reads its own half (nothing forwarded)."""
    md = _md([4 << 20])
    needs = [{"t0": (0, 2 << 20)}, {"t0": (2 << 20, 4 << 20)}]
    parts = read_parts(md, _report(md, needs), True, True, _exact)
    assert [p.apart for p in parts] == [frozenset({("t0", 0)})] * 2
    assert [p.batches for p in parts] == [(), ()]
