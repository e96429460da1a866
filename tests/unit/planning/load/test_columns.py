"""The columnar read assignment (``planning.load._columns`` through ``engine.load.exchange``):
every rank's part equals what the Python reference computes over the same needs (regular
layouts and listed shards mixed, checksum chunks smaller and larger than the shards, replicated
and resharded needs, several hosts or one), segments cut where the reference cuts them, and bad
reports are refused by name."""

from __future__ import annotations

import math
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.read_fixtures import split_metadata
from tests.support.hypothesis_profiles import examples
from unickpt.engine.load.exchange import read_parts
from unickpt.errors import PlanningError
from unickpt.format import Metadata, ShardRecord, TensorRecord, Topology
from unickpt.format.checksums import ChunkChecksums
from unickpt.format.layouts import SplitLayout, SplitShards
from unickpt.planning.load import _columns as load_columns
from unickpt.planning.load._columns import _segments as column_segments
from unickpt.planning.load.assign import _plain_segments as _segments
from unickpt.planning.load.assign import assign_reads, decode_part, plain_parts, report_needs
from unickpt.planning.load.runs import vectorized

SETTINGS = settings(max_examples=examples(200), deadline=None, derandomize=True, database=None)
DTYPES = {1: "uint8", 2: "bfloat16", 4: "float32"}


def chunk_sums(files, tensors, chunk=4096):
    """Chunk checksums (zeros) for files that end where their last shard ends."""
    sizes = [0] * len(files)
    for rec in tensors:
        for s in rec.shards:
            sizes[s.file_index] = max(sizes[s.file_index], s.byte_offset + s.byte_length)
    return ChunkChecksums.from_files(chunk, [(n, [0] * -(-n // chunk)) for n in sizes])


@st.composite
def jobs(draw):
    """Metadata with a regular layout over ``parts`` files and listed tensors in two more
    files, checksum chunks of 64 B to 4 KiB; and 2-9 ranks' needs of its shards."""
    parts = draw(st.integers(1, 12))
    entries = []
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=3)))
        entries.append((f"lay.t{i}", draw(st.sampled_from([1, 2, 4])), shape, draw(st.integers(0, len(shape) - 1))))
    lay = SplitLayout(tuple(range(parts)), tuple(entries))
    tensors = {
        fqn: TensorRecord(fqn, DTYPES[isz], shape, SplitShards(lay, e))
        for e, (fqn, isz, shape, _) in enumerate(entries)
    }
    pos = [0, 0]
    for i in range(draw(st.integers(0, 4))):  # listed: rows of dim 0 split in uneven pieces
        rows, cols = draw(st.integers(1, 60)), draw(st.integers(1, 8))
        cuts = sorted(set(draw(st.lists(st.integers(1, rows - 1), max_size=3)))) if rows > 1 else []
        shards = []
        for a, b in zip([0, *cuts], [*cuts, rows]):
            f = draw(st.integers(0, 1))
            nbytes = (b - a) * cols * 4
            shards.append(ShardRecord((a, 0), (b - a, cols), parts + f, pos[f], nbytes))
            pos[f] += -(-nbytes // 64) * 64 + draw(st.sampled_from([0, 64, 4096]))
        tensors[f"list.t{i}"] = TensorRecord(f"list.t{i}", "float32", (rows, cols), tuple(shards))
    files = tuple(f"data/s/f{i}.bin" for i in range(parts + 2))
    chunk = draw(st.sampled_from([64, 256, 4096]))
    md = Metadata(
        3,
        "s",
        1.0,
        Topology("fsdp2", parts),
        files,
        tensors,
        checksums=chunk_sums(files, tensors.values(), chunk=chunk),
    )
    keys = [(f, i) for f, rec in tensors.items() for i, s in enumerate(rec.shards) if s.byte_length]
    world = draw(st.integers(2, 9))
    needs = []
    for _ in range(world):
        mine = {}
        replicate = needs and draw(st.booleans())  # the same needs as an earlier rank (a replica)
        if replicate:
            needs.append(dict(needs[draw(st.integers(0, len(needs) - 1))]))
            continue
        for k in draw(st.lists(st.sampled_from(keys), max_size=12, unique=True)) if keys else []:
            rows = md.tensors[k[0]].shards[k[1]].lengths[0]
            lo = draw(st.integers(0, rows - 1))
            mine[k] = (lo, draw(st.integers(lo + 1, rows)))
        needs.append(mine)
    return md, needs


def _parts(md, needs, hosts, dedup, page_cache, extent, max_batch_bytes=64 << 20):
    names = list(md.tensors)
    gathered = [(h, report_needs(md, n, names)) for h, n in zip(hosts, needs)]
    # verified reads of chunk checksums use their vectorised arithmetic, as engine.read does
    extents = md.checksums.extents if extent == md.checksums.extent else vectorized(extent)
    wires = read_parts(md, gathered, dedup, page_cache, extents, max_batch_bytes)
    return [decode_part(w, names, list(n), r) for r, (w, n) in enumerate(zip(wires, needs))]


@SETTINGS
@given(
    jobs(),
    st.sampled_from(["one host", "two hosts", "dedup"]),
    st.sampled_from([64, 500, 64 << 20]),
    st.sampled_from([1 << 20, 1, 3]),
)
def test_each_ranks_part_is_the_references(job, mode, max_batch, block):
    """Every rank's part equals the reference's, with the passes over the needs in blocks of
    ``block`` needs (the default, and blocks of one and three needs, so that every block
    boundary is crossed)."""
    md, needs = job
    hosts = ["h0"] * len(needs) if mode != "two hosts" else [f"h{r % 2}" for r in range(len(needs))]
    dedup = True if mode == "dedup" else None
    for extent in (md.checksums.extent, lambda f, lo, hi: (lo, hi)):  # verified reads, or not
        with patch.object(load_columns, "BLOCK", block):
            got = _parts(md, needs, hosts, dedup, True, extent, max_batch)
        want = plain_parts(md, needs, hosts, dedup, True, extent, max_batch)
        assert [(p.batches, p.apart, p.shared) for p in got] == want


@settings(max_examples=examples(40), deadline=None, derandomize=True, database=None)
@given(jobs(), st.sampled_from([1 << 20, 1]))
def test_assign_reads_one_call_at_a_time_gives_the_thread_pools_parts(job, block):
    """``assign_reads`` takes how its passes run as a ``map``-like callable: the builtin ``map``
    (each pass run when its result is taken, one at a time) gives the parts the engine's thread
    pool gives (``read_parts``), wire for wire."""
    md, needs = job
    names = list(md.tensors)
    gathered = [(f"h{r % 2}", report_needs(md, n, names)) for r, n in enumerate(needs)]
    with patch.object(load_columns, "BLOCK", block):
        pooled = read_parts(md, gathered, True, False, md.checksums.extents)
        one_by_one = assign_reads(md, gathered, True, False, md.checksums.extents, run=map)
    assert one_by_one == pooled


@settings(max_examples=examples(60), deadline=None, derandomize=True, database=None)
@given(st.integers(3, 9), st.randoms(use_true_random=False), st.sampled_from([1 << 20, 2]))
def test_shards_every_rank_needs_are_the_references(world, rnd, block):
    """FSDP2-like state: a 0-d step and a small tensor every rank needs whole (replicated
    state: the assignment lists no consumers for them, all ranks are), a tensor every rank
    needs a disjoint piece of (its rows are tested), and sharded tensors some ranks need;
    each rank's part equals the reference's."""
    lay = SplitLayout((0, 1, 2), (("w", 4, (30, 8), 0), ("v", 4, (7,), 0)))
    tensors = {
        "w": TensorRecord("w", "float32", (30, 8), SplitShards(lay, 0)),
        "v": TensorRecord("v", "float32", (7,), SplitShards(lay, 1)),
        "step": TensorRecord("step", "float32", (), (ShardRecord((), (), 3, 0, 4),)),
        "bias": TensorRecord("bias", "float32", (6,), (ShardRecord((0,), (6,), 3, 64, 24),)),
        "row": TensorRecord("row", "float32", (90,), (ShardRecord((0,), (90,), 4, 0, 360),)),
    }
    files = tuple(f"data/s/f{i}.bin" for i in range(5))
    md = Metadata(
        3, "s", 1.0, Topology("fsdp2", 3), files, tensors, checksums=chunk_sums(files, tensors.values(), chunk=64)
    )
    needs = []
    for r in range(world):
        mine = {("step", 0): (0, 1), ("bias", 0): (0, 6)}
        lo, hi = r * 90 // world, (r + 1) * 90 // world
        mine[("row", 0)] = (lo, hi)
        for i in range(3):
            if rnd.random() < 0.6:
                a = rnd.randrange(0, 10)
                mine[("w", i)] = (a, rnd.randrange(a + 1, 11))
            if rnd.random() < 0.5 and i < 3:
                mine[("v", i)] = (0, min(3, 7 - 3 * i))
        needs.append(mine)
    hosts = [f"h{r % 2}" for r in range(world)]
    for dedup in (True, None):
        with patch.object(load_columns, "BLOCK", block):
            got = _parts(md, needs, hosts, dedup, True, md.checksums.extent)
        want = plain_parts(md, needs, hosts, dedup, True, md.checksums.extent, 64 << 20)
        assert [(p.batches, p.apart, p.shared) for p in got] == want


def test_a_resharding_load_reads_boundary_shards_apart_and_small_ones_once():
    """4 files of a 1,000 x 64 float32 tensor (250 rows, 64,000 B each) and a 2,000 B one, loaded
    by 3 ranks (334 / 334 / 332 rows): the big tensor's boundary shards are read apart (each rank
    its rows; 4 KiB chunks overlap by one chunk of ~64 KB); the small tensor's shards fit in one
    chunk each and are read once, by one consumer, and forwarded."""
    lay = SplitLayout((0, 1, 2, 3), (("big", 4, (1000, 64), 0), ("small", 4, (500,), 0)))
    tensors = {
        fqn: TensorRecord(fqn, "float32", shape, SplitShards(lay, e))
        for e, (fqn, _, shape, _) in enumerate(lay.entries)
    }
    files = tuple(f"f{i}" for i in range(4))
    md = Metadata(3, "s", 1.0, Topology("fsdp2", 4), files, tensors, checksums=chunk_sums(files, tensors.values()))
    needs: list[dict] = [{}, {}, {}]
    for fqn, n in (("big", 1000), ("small", 500)):
        per, c = n // 4, -(-n // 3)  # saved rows per file; rows per new rank (torch.chunk)
        for r in range(3):
            lo, hi = r * c, min(n, (r + 1) * c)
            for i in range(4):
                s0, s1 = max(lo, i * per), min(hi, (i + 1) * per)
                if s0 < s1:
                    needs[r][(fqn, i)] = (s0 - i * per, s1 - i * per)
    parts = _parts(md, needs, ["h0", "h1", "h2"], True, False, md.checksums.extent)
    assert parts[0].apart == {("big", 1)} and parts[1].apart == {("big", 1), ("big", 2)}
    assert parts[2].apart == {("big", 2)}
    forwarded = [b for p in parts for b in p.batches or () if b.forwarded]
    assert {k for b in forwarded for k in b.keys} <= {("small", i) for i in range(4)}
    for p in parts:
        for b in p.batches or ():
            assert all(k[0] == "small" for k in b.keys)


@settings(max_examples=examples(300), deadline=None, derandomize=True, database=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=40),
    st.integers(0, 400),
    st.sampled_from([1, 16, 64]),
)
def test_segments_cut_where_the_reference_cuts(raw, least, chunk):
    keys = sorted((f, off, n) for f, off, n in raw)
    where = {(f"k{i}", 0): k for i, k in enumerate(keys)}

    def cover(f, lo, hi):
        return (lo // chunk * chunk, -(-hi // chunk) * chunk) if hi > lo else (lo, hi)

    want = _segments(where, list(where), cover, least)
    files = np.array([k[0] for k in keys])
    lens = np.array([k[2] for k in keys])
    c = [cover(f, o, o + n) for f, o, n in keys]
    got = column_segments(files, lens, np.array([x[0] for x in c]), np.array([x[1] for x in c]), least)
    cut = [list(where)[i] for i in range(len(keys))]
    got_groups: list[list] = []
    for k, s in zip(cut, got.tolist()):
        if s == len(got_groups):
            got_groups.append([])
        got_groups[s].append(k)
    assert got_groups == want


def test_reports_out_of_range_are_refused():
    md = split_metadata()
    names = ["a"]
    ok = report_needs(md, {("a", 0): (0, 4)}, names)
    bad_shard = report_needs(md, {("a", 0): (0, 4)}, names)[:4] + (5).to_bytes(4, "little") + ok[8:]
    negative = report_needs(md, {("a", 1): (-2, 1)}, names)
    huge = report_needs(md, {("a", 1): (0, 1 << 40)}, names)  # rows past 32 bits: kept in 64, no wrap
    cases = [
        ([("h", ok), ("h", ok[:-1])], "not whole rows"),
        ([("h", ok), ("h", bad_shard)], "tensor or shard"),
        ([("h", ok), ("h", report_needs(md, {("a", 1): (3, 1)}, names))], "out of order"),
        ([("h", ok), ("h", negative)], "out of order"),
        ([("h", ok), ("h", ok), ("h", ok + bad_shard)], "tensor or shard"),  # in a later block
    ]
    for block in (1 << 20, 1):
        for gathered, words in cases:
            with patch.object(load_columns, "BLOCK", block), pytest.raises(PlanningError, match=words):
                read_parts(md, gathered, True, False, vectorized(lambda f, lo, hi: (lo, hi)))
    wire = read_parts(md, [("h", ok), ("h", huge)], True, False, vectorized(lambda f, lo, hi: (lo, hi)))
    assert len(wire) == 2  # accepted: the rows are only compared, never used as sizes here
    with pytest.raises(PlanningError, match="rank 1 received no usable part"):
        decode_part(["not", "a part"], names, [("a", 0)], 1)


def test_locations_of_many_chunks_are_the_hand_rows():
    """``SplitLayout.locations`` against each chunk's own record (rows by ``torch.chunk``'s rule,
    written plainly in test_layouts), for every part of every entry, tail parts included."""
    lay = SplitLayout(
        (3, 0, 2, 1, 4), (("a", 4, (11, 3), 0), ("b", 2, (4, 7), 1), ("c", 1, (0,), 0), ("d", 4, (2,), 0))
    )
    e = np.repeat(np.arange(4), 5)
    p = np.tile(np.arange(5), 4)
    files, offsets, lengths, row_bytes = lay.locations(e, p)
    for j, (ei, pi) in enumerate(zip(e.tolist(), p.tolist())):
        rec = lay.shard(ei, pi)
        assert (files[j], offsets[j], lengths[j]) == (rec.file_index, rec.byte_offset, rec.byte_length)
        assert row_bytes[j] == math.prod(rec.lengths[1:]) * lay.entries[ei][1]


@SETTINGS
@given(jobs(), st.integers(1, 7))
def test_geometry_in_blocks_is_each_shards_own(job, block):
    """Every need's file, offset, length and row bytes, computed in blocks of a few needs, are
    its shard's (``shard_location`` / ``shard_row_bytes``, one shard at a time)."""
    from unickpt.format.dtypes import itemsize
    from unickpt.format.layouts import shard_location, shard_row_bytes
    from unickpt.planning.load._columns import NEED_DTYPE
    from unickpt.planning.load.shards import shard_geometry

    md, needs = job
    names = list(md.tensors)
    rows = [(names.index(f), i, lo, hi) for n in needs for (f, i), (lo, hi) in n.items()]
    arr = np.array(rows, dtype=NEED_DTYPE) if rows else np.zeros(0, NEED_DTYPE)
    got = [c.tolist() for c in shard_geometry(md, arr["tensor"], arr["shard"], block=block)]
    for j, (t, i, _, _) in enumerate(rows):
        rec = md.tensors[names[t]]
        want = (*shard_location(rec.shards, i), shard_row_bytes(rec.shards, i, itemsize(rec.dtype)))
        assert tuple(c[j] for c in got) == want


@settings(max_examples=examples(200), deadline=None, derandomize=True, database=None)
@given(st.lists(st.integers(0, 9), max_size=12))
def test_shard_numbers_are_one_each_and_like_shards_adjacent(counts):
    """The job's shard numbering (``_numbering``) gives every (tensor, shard) a number of its
    own in [0, total); of tensors with equal shard counts, shard s of one tensor and shard s of
    the next such tensor are numbered one apart (one rank's needs fall together)."""
    first, stride = load_columns._numbering(np.asarray(counts, dtype=np.int64))
    numbers = [int(first[t] + s * stride[t]) for t, c in enumerate(counts) for s in range(c)]
    assert sorted(numbers) == list(range(sum(counts)))
    for t, u in zip(range(len(counts)), range(1, len(counts))):
        later = [v for v in range(u, len(counts)) if counts[v] == counts[t]]
        if later and counts[t]:
            for s in range(counts[t]):
                assert first[later[0]] + s * stride[later[0]] == first[t] + s * stride[t] + 1
