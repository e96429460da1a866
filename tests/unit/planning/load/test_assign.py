"""plain_batches: every needed shard read exactly once, by a rank that needs it, balanced."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.read_fixtures import one_file_metadata as _md
from tests.support.hypothesis_profiles import examples
from unickpt.format.records import Metadata, ShardRecord, TensorRecord, Topology
from unickpt.planning.load.assign import plain_batches


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=30), st.integers(1, 6), st.data())
def test_each_needed_shard_read_once_by_a_consumer(sizes, world, data):
    md = _md(sizes)
    needs = [[(f"t{i}", 0) for i in range(len(sizes)) if data.draw(st.booleans())] for _ in range(world)]
    batches = plain_batches(md, needs, max_batch_bytes=data.draw(st.integers(1, 20000)))
    read = [k for b in batches for k in b.keys]
    needed = {k for ks in needs for k in ks}
    assert sorted(read) == sorted(needed)  # exactly once
    for b in batches:
        assert b.reader in b.consumers
        for k in b.keys:
            assert set(b.consumers) == {r for r, ks in enumerate(needs) if k in ks}
        ends = [o + sizes[int(k[0][1:])] for k, o in zip(b.keys, b.offsets)]
        assert all(e <= b.nbytes for e in ends)
        assert all(a + sizes[int(k[0][1:])] <= c for k, a, c in zip(b.keys, b.offsets, b.offsets[1:]))
    assert [b.batch_id for b in batches] == list(range(len(batches)))
    # deterministic: every rank computes the same batches
    assert plain_batches(md, needs, 20000) == plain_batches(md, needs, 20000)


def test_replicated_load_is_spread_over_ranks():
    md = _md([1000] * 8)
    everyone = [(f"t{i}", 0) for i in range(8)]
    batches = plain_batches(md, [everyone] * 4)
    per_reader = {}
    for b in batches:
        per_reader[b.reader] = per_reader.get(b.reader, 0) + sum(1000 for _ in b.keys)
    assert per_reader == {0: 2000, 1: 2000, 2: 2000, 3: 2000}


def test_vectorized_intersection_matches_scalar_path(monkeypatch):
    """plan_local_load gives the same copies whether a tensor has few or many saved shards."""
    import random

    from unickpt.planning.boxes import chunk_bounds
    from unickpt.planning.load import overlap as load_overlap
    from unickpt.planning.load import shards as load_shards
    from unickpt.planning.specs import ShardSpec

    rng = random.Random(0)
    for _ in range(30):
        shape = (rng.randint(1, 60), rng.randint(1, 9))
        parts = rng.randint(1, 40)
        shards = []
        for i in range(parts):
            o, n = chunk_bounds(shape[0], parts, i)
            if n:
                shards.append(ShardRecord((o, 0), (n, shape[1]), 0, 0, n * shape[1] * 4))
        md = Metadata(1, "x", 0.0, Topology("t", 1), ("f",), {"w": TensorRecord("w", "float32", shape, tuple(shards))})
        tparts = rng.randint(1, 7)
        specs = []
        for j in range(tparts):
            o, n = chunk_bounds(shape[1], tparts, j)
            specs.append(ShardSpec("w", "float32", shape, (0, o), (shape[0], n)))
        fast = load_overlap.plan_local_load(md, specs)
        with monkeypatch.context() as m:
            m.setattr(load_shards, "INDEX_FROM", 10**9)  # every tensor scanned
            slow = load_overlap.plan_local_load(md, specs)
        assert fast == slow


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=30), st.integers(2, 6), st.sampled_from([64, 1024, 4096]))
def test_chunk_aligned_segments_read_each_chunk_once(sizes, world, chunk):
    """With checksum chunks, shared shards are taken in segments cut only between chunks: no
    chunk is read by two readers, and each segment has one reader (any consumer of it)."""
    md = _md(sizes)
    needs = [[(f"t{i}", 0) for i in range(len(sizes))] for _ in range(world)]  # every rank needs all

    def cover(f, lo, hi):
        return lo // chunk * chunk, -(-hi // chunk) * chunk

    batches = plain_batches(md, needs, cover=cover, segment_bytes=4 * chunk)
    read_by = {}
    for b in batches:
        for k in b.keys:
            s = md.tensors[k[0]].shards[k[1]]
            lo, hi = cover(0, s.byte_offset, s.byte_offset + s.byte_length)
            for c in range(lo // chunk, hi // chunk):
                read_by.setdefault(c, set()).add(b.reader)
    assert all(len(r) == 1 for r in read_by.values()), read_by
    assert sorted(k for b in batches for k in b.keys) == sorted((f"t{i}", 0) for i in range(len(sizes)))
