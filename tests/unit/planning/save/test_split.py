"""Split tensors in save plans (``planning.save.split``) on worked examples: the metadata of a
regular job grows with the tensors, not with the ranks; tensors with empty tail chunks are laid
out too; a rank left without a file keeps empty chunks as rows. The property on random jobs
(split tensors land where their layout says): ``test_plan_properties.py``."""

from __future__ import annotations

from unickpt.format import decode_metadata, encode_metadata
from unickpt.format.build import SaveSource, build_metadata
from unickpt.format.checksums import ChunkChecksums
from unickpt.format.layouts import SplitShards
from unickpt.planning.save import LocalSavePlan, plan_save
from unickpt.planning.specs import ShardSpec


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    c = -(-n // parts)
    lo = min(n, i * c)
    return lo, min(n, lo + c) - lo


def _metadata(gplan, world):
    sums = []
    for rp in gplan.rank_plans:
        ends: dict[str, int] = {}
        for e in rp.entries:
            ends[e.file] = max(ends.get(e.file, 0), e.byte_offset + e.byte_length)
        sums.append((4096, {f: (n, [0] * -(-n // 4096)) for f, n in ends.items()}))
    return build_metadata(gplan, sums, SaveSource("fsdp2", None, ()), world, {})


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


def test_tensors_with_empty_tail_chunks_are_laid_out_too() -> None:
    """torch.chunk of 9 rows over 4 ranks fills 3 chunks (3, 3, 3, 0): as FSDP2 shards a
    vocabulary of 128,256 rows over 4,096 ranks (4,008 chunks). Rank 3 writes nothing of it and
    the layout's part 3 is empty; the tensor needs no rows either way."""
    world = 4
    plans = []
    for r in range(world):
        specs = []
        for fqn, rows in (("model.full", 8), ("model.tail", 9), ("model.few", 2)):
            lo, n = _chunk(rows, world, r)
            specs.append(ShardSpec(fqn, "float32", (rows, 3), (lo, 0), (n, 3)))
        plans.append(LocalSavePlan(r, tuple(specs)))
    gplan = plan_save(plans, "20250101T000000-0123456789ab", 1)
    md = decode_metadata(encode_metadata(_metadata(gplan, world)))
    for fqn, rows, sizes in (
        ("model.full", 8, [2, 2, 2, 2]),
        ("model.tail", 9, [3, 3, 3, 0]),
        ("model.few", 2, [1, 1, 0, 0]),
    ):
        shards = md.tensors[fqn].shards
        assert isinstance(shards, SplitShards) and sum(sizes) == rows, fqn
        assert [s.lengths for s in shards] == [(n, 3) for n in sizes]
        assert [s.byte_length for s in shards] == [n * 3 * 4 for n in sizes]
    planned = {
        (plans[rp.rank].shards[e.item_index].fqn, rp.rank): (gplan.files.index(e.file), e.byte_offset)
        for rp in gplan.rank_plans
        for e in rp.entries
    }
    for fqn in ("model.full", "model.tail", "model.few"):
        for r, s in enumerate(md.tensors[fqn].shards):
            if s.byte_length:
                assert (s.file_index, s.byte_offset) == planned[(fqn, r)]


def test_a_rank_left_without_a_file_keeps_empty_chunks_as_rows() -> None:
    """Two ranks, one tensor of 1 row: rank 1 would hold no file at all, so the tensor is not laid
    out (a layout names a file of every rank); the plan and its metadata stay valid."""
    plans = [
        LocalSavePlan(0, (ShardSpec("model.t", "float32", (1, 4), (0, 0), (1, 4)),)),
        LocalSavePlan(1, (ShardSpec("model.t", "float32", (1, 4), (1, 0), (0, 4)),)),
    ]
    gplan = plan_save(plans, "20250101T000000-0123456789ab", 1)
    md = decode_metadata(encode_metadata(_metadata(gplan, 2)))
    assert not isinstance(md.tensors["model.t"].shards, SplitShards)
    assert [s.lengths for s in md.tensors["model.t"].shards] == [(1, 4)]
