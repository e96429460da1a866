"""assign_reads: every needed shard read exactly once, by a rank that needs it, balanced."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.format.records import Metadata, ShardRecord, TensorRecord, Topology
from unickpt.planning.read_assignment import assign_reads


def _md(sizes: list[int]) -> Metadata:
    tensors = {}
    for i, n in enumerate(sizes):
        tensors[f"t{i}"] = TensorRecord(f"t{i}", "uint8", (n,), (ShardRecord((0,), (n,), 0, 0, n, 0),))
    return Metadata(1, "x", 0.0, Topology("torch", 1), ("f",), tensors)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=30), st.integers(1, 6), st.data())
def test_each_needed_shard_read_once_by_a_consumer(sizes, world, data):
    md = _md(sizes)
    needs = [[(f"t{i}", 0) for i in range(len(sizes)) if data.draw(st.booleans())] for _ in range(world)]
    batches = assign_reads(md, needs, max_batch_bytes=data.draw(st.integers(1, 20000)))
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
    assert assign_reads(md, needs, 20000) == assign_reads(md, needs, 20000)


def test_replicated_load_is_spread_over_ranks():
    md = _md([1000] * 8)
    everyone = [(f"t{i}", 0) for i in range(8)]
    batches = assign_reads(md, [everyone] * 4)
    per_reader = {}
    for b in batches:
        per_reader[b.reader] = per_reader.get(b.reader, 0) + sum(1000 for _ in b.keys)
    assert per_reader == {0: 2000, 1: 2000, 2: 2000, 3: 2000}
