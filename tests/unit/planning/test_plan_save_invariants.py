"""``planning.save.plan.plan_save`` on random jobs (hypothesis): deduplication, replica source,
worst-fit balance and the byte layout, each checked against the test's own oracles (element
counts with numpy: ``support.boxes``; element sizes from torch), never against unickpt's own
tiling check. Issue 11: "tests of ... plan_save ... that do not exist today"."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.boxes import element_size, numel, tiles_exactly
from tests.support.hypothesis_profiles import examples
from unickpt.errors import PlanningError
from unickpt.planning.save import GlobalSavePlan, LocalSavePlan, plan_save
from unickpt.planning.specs import BlobSpec, ShardSpec

SETTINGS = settings(max_examples=examples(150), deadline=None)
DTYPES = ["float32", "bfloat16", "int64", "uint8", "float64"]
ALIGN = 64  # the documented entry alignment (planning.save.model: ENTRY_ALIGN)


@st.composite
def jobs(draw, max_ws: int = 6) -> tuple[list[LocalSavePlan], int]:
    """Local plans of a random job: each tensor replicated, or split in blocks along one dim
    (uneven), each block held by one or several ranks (replicas, maybe naming a source rank);
    ranks without a block hold an empty box or nothing; random per-rank blobs."""
    ws = draw(st.integers(1, max_ws))
    per_rank: list[list[ShardSpec]] = [[] for _ in range(ws)]
    for t in range(draw(st.integers(1, 4))):
        fqn = f"model.t{t}"
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=2)))
        dtype = draw(st.sampled_from(DTYPES))
        dim = draw(st.integers(0, len(shape) - 1))
        k = draw(st.integers(1, min(ws, shape[dim])))
        cuts = sorted(draw(st.sets(st.integers(1, shape[dim] - 1), min_size=k - 1, max_size=k - 1))) if k > 1 else []
        bounds = [0, *cuts, shape[dim]]
        holders: dict[int, list[int]] = {b: [b] for b in range(k)}  # block -> ranks
        empty: list[int] = []
        for r in range(k, ws):
            what = draw(st.sampled_from(["replica", "empty", "nothing"]))
            if what == "replica":
                holders[r % k].append(r)
            elif what == "empty":
                empty.append(r)
        for b, ranks in holders.items():
            offs = tuple(bounds[b] if d == dim else 0 for d in range(len(shape)))
            lens = tuple(bounds[b + 1] - bounds[b] if d == dim else shape[d] for d in range(len(shape)))
            source = draw(st.sampled_from(["none", "holder", "any"])) if len(ranks) > 1 else "none"
            named = {"none": None, "holder": draw(st.sampled_from(ranks)), "any": draw(st.integers(0, ws - 1))}
            for r in ranks:
                per_rank[r].append(ShardSpec(fqn, dtype, shape, offs, lens, named[source]))
        for r in empty:
            offs = tuple(shape[d] if d == dim else 0 for d in range(len(shape)))
            lens = tuple(0 if d == dim else shape[d] for d in range(len(shape)))
            per_rank[r].append(ShardSpec(fqn, dtype, shape, offs, lens))
    plans = []
    for r in range(ws):
        shards = draw(st.permutations(per_rank[r]))
        blobs = tuple(BlobSpec(f"extra/{r}/{i}", draw(st.integers(0, 200))) for i in range(draw(st.integers(0, 2))))
        plans.append(LocalSavePlan(r, tuple(shards), blobs))
    return plans, draw(st.integers(1, 3))


def _nbytes(spec: ShardSpec) -> int:
    return numel(spec.lengths) * element_size(spec.dtype)


def _all_writers(plans: list[LocalSavePlan], g: GlobalSavePlan) -> list[tuple]:
    """``g.writers`` (the boxes outside the layouts) and the boxes of the tensors its layouts
    describe: rank r writes ``torch.chunk`` part r (computed here), the spec of its that holds it."""
    out = list(g.writers)
    for _files, entries in g.layouts:
        for fqn, d in entries:
            shape = g.tensors[fqn][1]
            size = -(-shape[d] // len(plans))
            for r, plan in enumerate(plans):
                lo = min(shape[d], r * size)
                n = min(shape[d], lo + size) - lo
                if not n:
                    continue
                offs = tuple(lo if i == d else 0 for i in range(len(shape)))
                lens = tuple(n if i == d else shape[i] for i in range(len(shape)))
                idx = [i for i, s in enumerate(plan.shards) if (s.fqn, s.offsets, s.lengths) == (fqn, offs, lens)]
                assert len(idx) == 1, (fqn, r, idx)
                out.append((fqn, offs, lens, r, idx[0]))
    return out


def _check_plan(plans: list[LocalSavePlan], files_per_rank: int, g: GlobalSavePlan) -> None:
    """Every invariant of a global plan, computed independently of the planner."""
    ws = len(plans)
    writers = _all_writers(plans, g)
    assert not {w[0] for w in g.writers} & {fqn for _f, entries in g.layouts for fqn, _d in entries}
    # tensors: every rank's dtype and shape
    want_tensors = {s.fqn: (s.dtype, s.global_shape) for p in plans for s in p.shards}
    assert g.tensors == want_tensors
    # dedup: the written boxes tile every tensor exactly once; each writer holds its box
    written: dict[str, list] = defaultdict(list)
    for fqn, offs, lens, rank, idx in writers:
        spec = plans[rank].shards[idx]
        assert (spec.fqn, spec.offsets, spec.lengths) == (fqn, offs, lens)
        assert numel(lens) > 0  # empty shards are never written
        written[fqn].append((offs, lens))
    for fqn, (_dtype, shape) in want_tensors.items():
        assert tiles_exactly(shape, written[fqn]), (fqn, shape, written[fqn])
    # replica source: the lowest named source that holds the box writes it
    holders: dict[tuple, list[tuple[int, ShardSpec]]] = defaultdict(list)
    for p in plans:
        for s in p.shards:
            holders[(s.fqn, s.offsets, s.lengths)].append((p.rank, s))
    for fqn, offs, lens, rank, _idx in writers:
        hs = holders[(fqn, offs, lens)]
        ranks = {r for r, _ in hs}
        named = sorted({s.replica_source for _, s in hs if s.replica_source is not None} & ranks)
        if len(hs) > 1 and named:
            assert rank == named[0], (fqn, offs, named, rank)
    # layout: files of each rank, aligned non-overlapping entries, byte sizes from torch
    name = re.compile(r"^r(\d{5})-(\d{2})\.bin$")  # plans name files by (rank, part)
    assert [rp.rank for rp in g.rank_plans] == list(range(ws))
    all_files: list[str] = []
    for rp in g.rank_plans:
        plan = plans[rp.rank]
        assert rp.save_id == g.save_id
        mine = {(idx, s) for s_fqn, offs, lens, r, idx in writers if r == rp.rank for s in [plan.shards[idx]]}
        tensor_entries = [e for e in rp.entries if not e.blob_key]
        blob_entries = [e for e in rp.entries if e.blob_key]
        assert sorted(e.item_index for e in tensor_entries) == sorted(idx for idx, _ in mine)
        for e in tensor_entries:
            assert e.byte_length == _nbytes(plan.shards[e.item_index])
        assert sorted((e.blob_key, e.byte_length) for e in blob_entries) == sorted(
            (b.key, b.nbytes) for b in plan.blobs
        )
        assert all(e.item_index == -1 for e in blob_entries)
        files = list(dict.fromkeys(e.file for e in rp.entries))
        assert len(files) <= files_per_rank
        for f in files:
            m = name.match(f)
            assert m and int(m.group(1)) == rp.rank and int(m.group(2)) < files_per_rank, f
            entries = [e for e in rp.entries if e.file == f]
            ends = 0
            for e in entries:  # in byte order, aligned, not overlapping
                assert e.byte_offset % ALIGN == 0 and e.byte_offset >= ends
                ends = e.byte_offset + e.byte_length
        # entries are grouped by file
        assert [e.file for e in rp.entries] == sorted((e.file for e in rp.entries), key=files.index)
        # list scheduling to the lightest file: file sizes differ by at most the largest item;
        # split tensors laid out alike on every rank (g.layouts) are balanced on chunk 0, the
        # largest: rank 0's files; other ranks' shorter or empty tail chunks follow rank 0's choice
        if len(files) > 1 and (not g.layouts or rp.rank == 0):
            sizes = [sum(e.byte_length for e in rp.entries if e.file == f) for f in files]
            assert max(sizes) - min(sizes) <= max(e.byte_length for e in rp.entries)
        all_files += files
    assert list(g.files) == all_files and len(set(all_files)) == len(all_files)


@given(jobs())
@SETTINGS
def test_issue11_plan_save_invariants_on_random_jobs(job):
    plans, files_per_rank = job
    g = plan_save(plans, "20250101T000000-abc", files_per_rank)
    _check_plan(plans, files_per_rank, g)
    assert plan_save(plans, "20250101T000000-abc", files_per_rank) == g  # deterministic


@given(st.integers(2, 6), st.lists(st.tuples(st.integers(1, 40), st.sampled_from(DTYPES)), min_size=1, max_size=12))
@SETTINGS
def test_issue11_plan_save_worst_fit_balances_full_replicas(ws, tensors):
    """Pure data parallelism (every rank holds every tensor, no source named): each tensor is
    written once, and the ranks' byte loads differ by at most the largest tensor."""
    plans = [
        LocalSavePlan(r, tuple(ShardSpec(f"model.p{i}", dt, (n,), (0,), (n,)) for i, (n, dt) in enumerate(tensors)))
        for r in range(ws)
    ]
    g = plan_save(plans, "s")
    _check_plan(plans, 1, g)
    load = [0] * ws
    for fqn, _o, lens, rank, _i in g.writers:
        load[rank] += numel(lens) * element_size(g.tensors[fqn][0])
    biggest = max(n * element_size(dt) for n, dt in tensors)
    assert max(load) - min(load) <= biggest, load


def test_issue11_plan_save_refuses_disagreeing_metadata_and_bad_tilings():
    w = ShardSpec("model.w", "float32", (4, 2), (0, 0), (2, 2))
    rest = ShardSpec("model.w", "float32", (4, 2), (2, 0), (2, 2))
    with pytest.raises(PlanningError, match=r"model\.w: rank 1 has dtype bfloat16 shape \(4, 2\)"):
        plan_save(
            [LocalSavePlan(0, (w,)), LocalSavePlan(1, (ShardSpec("model.w", "bfloat16", (4, 2), (2, 0), (2, 2)),))], "s"
        )
    with pytest.raises(PlanningError, match=r"model\.w: rank 1 has dtype float32 shape \(5, 2\)"):
        plan_save(
            [LocalSavePlan(0, (w,)), LocalSavePlan(1, (ShardSpec("model.w", "float32", (5, 2), (2, 0), (2, 2)),))], "s"
        )
    with pytest.raises(PlanningError, match="do not tile"):  # rows 2-3 saved by nobody
        plan_save([LocalSavePlan(0, (w,)), LocalSavePlan(1, ())], "s")
    with pytest.raises(PlanningError, match="do not tile"):  # overlapping, different boxes
        overlap = ShardSpec("model.w", "float32", (4, 2), (1, 0), (3, 2))
        plan_save([LocalSavePlan(0, (w,)), LocalSavePlan(1, (overlap,))], "s")
    with pytest.raises(PlanningError, match="files_per_rank"):
        plan_save([LocalSavePlan(0, (w, rest))], "s", 0)
    with pytest.raises(PlanningError, match="in order"):
        plan_save([LocalSavePlan(1, (w,)), LocalSavePlan(0, (rest,))], "s")
