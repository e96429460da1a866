"""Regular layouts in save plans (``planning.regular``): on random jobs mixing tensors every rank
holds one chunk of (FSDP ``Shard(0)`` over the job), replicated tensors and irregular shards, the
planned bytes of every split tensor are exactly where the metadata's layout says they are, every
other box keeps its row, and the metadata's size grows with the tensors, not with the ranks."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.engine.commit import SaveSource, build_metadata
from unickpt.format import decode_metadata, encode_metadata
from unickpt.format.checksums import ChunkChecksums
from unickpt.format.layouts import SplitShards
from unickpt.format.validation import validate_metadata
from unickpt.planning.save_plan import LocalSavePlan, plan_save
from unickpt.planning.specs import ShardSpec

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    c = -(-n // parts)
    lo = min(n, i * c)
    return lo, min(n, lo + c) - lo


@st.composite
def jobs(draw):
    world = draw(st.integers(2, 5))
    specs: list[list[ShardSpec]] = [[] for _ in range(world)]
    kinds = {}
    for t in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["split", "split", "replicated", "rows-of-rank0"]))
        shape = (draw(st.integers(1, 12)), draw(st.integers(1, 4)))
        d = draw(st.integers(0, 1)) if kind == "split" else 0
        fqn = f"model.t{t}"
        kinds[fqn] = (kind, d)
        for r in range(world):
            if kind == "split":
                lo, n = _chunk(shape[d], world, r)
                offs = (lo, 0) if d == 0 else (0, lo)
                lens = (n, shape[1]) if d == 0 else (shape[0], n)
            elif kind == "replicated":
                offs, lens = (0, 0), shape
            else:  # rank 0 holds all of it, the others nothing
                offs, lens = (0, 0), (shape if r == 0 else (0, shape[1]))
            specs[r].append(ShardSpec(fqn, "float32", shape, offs, lens))
    files = draw(st.integers(1, 3))
    return [LocalSavePlan(r, tuple(s)) for r, s in enumerate(specs)], files, kinds


def _metadata(gplan, world):
    sums = []
    for rp in gplan.rank_plans:
        ends: dict[str, int] = {}
        for e in rp.entries:
            ends[e.file] = max(ends.get(e.file, 0), e.byte_offset + e.byte_length)
        sums.append((4096, {f: (n, [0] * -(-n // 4096)) for f, n in ends.items()}))
    return build_metadata(gplan, sums, SaveSource("fsdp2", None, ()), world, {})


@given(jobs())
@SETTINGS
def test_split_tensors_land_where_their_layout_says(job) -> None:
    plans, files, kinds = job
    world = len(plans)
    gplan = plan_save(plans, "20250101T000000-0123456789ab", files)
    md = _metadata(gplan, world)
    validate_metadata(md)
    back = decode_metadata(encode_metadata(md))
    planned = {}  # (fqn, rank) -> (file, offset, length), from the rank plans
    for rp in gplan.rank_plans:
        for e in rp.entries:
            fqn = plans[rp.rank].shards[e.item_index].fqn
            planned[(fqn, rp.rank)] = (gplan.files.index(e.file), e.byte_offset, e.byte_length)
    for fqn, (kind, d) in kinds.items():
        rec = back.tensors[fqn]
        shape = rec.shape
        every_chunk = kind == "split" and _chunk(shape[d], world, world - 1)[1] > 0
        assert isinstance(rec.shards, SplitShards) == every_chunk, (fqn, kind)
        if every_chunk:
            for r, s in enumerate(rec.shards):  # part r: rank r's chunk, at its planned bytes
                assert (s.file_index, s.byte_offset, s.byte_length) == planned[(fqn, r)]
        total = sum(s.byte_length for s in rec.shards)
        assert total == math.prod(shape) * 4


def test_metadata_of_a_regular_job_grows_with_tensors_not_ranks() -> None:
    def size(world: int) -> int:
        plans = []
        for r in range(world):
            specs = []
            for t in range(30):
                lo, n = _chunk(4096, world, r)
                specs.append(ShardSpec(f"model.t{t}", "float32", (4096, 8), (lo, 0), (n, 8)))
            plans.append(LocalSavePlan(r, tuple(specs)))
        gplan = plan_save(plans, "20250101T000000-0123456789ab", 2)
        md = _metadata(gplan, world)
        assert all(isinstance(t.shards, SplitShards) for t in md.tensors.values())
        doc = encode_metadata(md)
        assert isinstance(md.checksums, ChunkChecksums)
        return len(doc)

    small, big = size(8), size(256)
    # 32x the ranks: only the file names, sizes and layouts' file lists grow (~70 bytes per file)
    assert big - small < 2 * 256 * 80
