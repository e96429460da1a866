"""FSDP1 (flat parameters): bit-exact resharding to and from FSDP1 / FSDP2 / DDP / torch, with
and without use_orig_params, SHARD_GRAD_OP, NO_SHARD, SGD; and a save_view that issues no
collective, makes zero-copy views, saves no padding and refuses unsharded flat parameters.

Checkpoints are saved once per source world size (all sources of one world size in one spawn)
and every load of one destination world size runs in one spawn (the ws-4 loads in the ws-4 saves'
spawn); each pair is still its own test. The save_view and tied-weights checks share one ws-2 spawn.
"""

from __future__ import annotations

import os

import pytest

from tests.workers.fsdp1_workers import load_many, save_many, save_view_and_tied_saves
from tests.workers.harness import SaveLoadMatrix, run_ranks
from tests.workers.reshard_workers import check

# (source spec, source ws, destination spec, destination ws); specs: see fsdp1_workers.make
PAIRS = [
    ("fsdp", 4, "fsdp", 2),
    ("fsdp-orig", 4, "fsdp-orig", 2),
    ("fsdp-orig", 4, "fsdp", 2),
    ("fsdp-orig", 4, "fsdp-orig-warm", 2),
    ("fsdp", 4, "fsdp", 3),
    ("fsdp-orig", 4, "fsdp-orig", 3),
    ("fsdp", 4, "fsdp-orig", 3),
    ("fsdp", 4, "fsdp", 1),
    ("fsdp-orig", 4, "fsdp-orig", 1),
    ("fsdp", 2, "fsdp2", 4),
    ("fsdp-orig", 2, "fsdp2", 4),
    ("fsdp2", 4, "fsdp", 3),
    ("fsdp2", 4, "fsdp-orig", 3),
    ("fsdp", 4, "torch", 1),
    ("fsdp-orig", 4, "torch", 1),
    ("ddp", 2, "fsdp", 4),
    ("ddp", 2, "fsdp-orig", 4),
    ("fsdp-sgo", 2, "fsdp-orig-sgo", 3),
    ("fsdp-noshard", 2, "fsdp-orig", 3),
    ("fsdp-sgd", 2, "fsdp-orig-sgd", 4),
    ("fsdp-sgd", 2, "torch-sgd", 1),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every source saved once and every pair loaded, one spawned job per world size doing that
    size's saves and the loads whose checkpoint an earlier job saved (ws 4 saves and loads in one
    job), run lazily as the tests ask. Returns ``(source(spec, ws) -> (ckpt, ref), load(pair) ->
    per-rank results)``."""
    matrix = SaveLoadMatrix(save_many, load_many, PAIRS, str(tmp_path_factory.mktemp("fsdp1")))
    return matrix.source, matrix.load


@pytest.mark.parametrize("src,src_ws,dst,dst_ws", PAIRS, ids=[f"{a}{b}-to-{c}{d}" for a, b, c, d in PAIRS])
def test_fsdp1_reshard_bit_exact(runs, src, src_ws, dst, dst_ws):
    source, load = runs
    _, ref = source(src, src_ws)
    check(load((src, src_ws, dst, dst_ws)), ref, src_ws)


def test_fsdp1_checkpoint_has_irregular_boxes_and_no_padding(runs):
    """The ws=4 flat checkpoint: exact bytes (no padding), some tensors split into several boxes
    that are not row blocks of whole rows, and every tensor tiled (counted element by element by
    the test's own oracle, ``support.boxes``)."""
    from tests.support.boxes import element_size, numel, tiles_exactly
    from unickpt.format import decode_metadata

    source, _ = runs
    ckpt, ref = source("fsdp", 4)
    md = decode_metadata(open(os.path.join(ckpt, "unickpt.metadata.json"), "rb").read())
    assert set(ref["state"]) == set(md.tensors)
    expect = sum(numel(t.shape) * element_size(t.dtype) for t in md.tensors.values())
    assert md.total_tensor_bytes == expect
    partial_rows = 0
    for t in md.tensors.values():
        boxes = [(s.offsets, s.lengths) for s in t.shards]
        assert tiles_exactly(tuple(t.shape), boxes), t.fqn
        partial_rows += sum(1 for _, lens in boxes if len(lens) == 2 and lens[0] == 1 and lens[1] < t.shape[1])
    assert partial_rows > 0
    w = md.tensors["model.blocks.0.fc1.weight"]
    assert len(w.shards) > 1


SAVE_VIEW_SPECS = ["fsdp", "fsdp-orig", "fsdp-sgo"]


@pytest.fixture(scope="module")
def ws2_checks(tmp_path_factory):
    """One ws-2 spawn: ``no_collective_save_view`` of SAVE_VIEW_SPECS, then the tied-weights model
    saved with use_orig_params False and True. Returns ``(per-rank save_view results, {flag: ckpt})``."""
    root = tmp_path_factory.mktemp("ws2")
    tied = {flag: str(root / f"tied-{flag}") for flag in (False, True)}
    res = run_ranks(save_view_and_tied_saves, 2, SAVE_VIEW_SPECS, [[ckpt, flag] for flag, ckpt in tied.items()])
    return res, tied


def test_fsdp1_save_view_issues_no_collective(ws2_checks):
    res, _ = ws2_checks
    for rank, per_rank in enumerate(res):
        for spec, r in zip(SAVE_VIEW_SPECS, per_rank):
            assert r["adapter"] == "fsdp"
            assert "summon_full_params" in r["refused"] and "FSDP module" in r["refused"]
            assert not r["calls"], (rank, spec, r["calls"])
            assert r["zero_copy"], (rank, spec)
            assert not r["wrong"], (rank, spec, r["wrong"][:5])
            assert r["model_numel"] == r["local_numel"], (rank, spec)
            assert r["has_groups"]
            if rank == 1:
                assert r["padded_numel"] > r["local_numel"]  # padding exists and is not saved
            assert any(k.endswith(".exp_avg_sq") for k in r["optim_keys"])
            assert any(k.endswith(".step") for k in r["optim_keys"])


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_tied_buffers_ignored_into_torch(ws2_checks, use_orig_params):
    """Tied weights are saved under both names, BatchNorm buffers and an ignored module's
    parameters as plain replicated tensors: a plain torch model loads it strictly, bit-exact."""
    import torch

    import unickpt
    from tests.workers.fsdp1_workers import tied_bn_model

    ckpt = ws2_checks[1][use_orig_params]
    ref = tied_bn_model(0).state_dict()
    model = tied_bn_model(1)
    unickpt.load(ckpt, {"model": model}, framework="torch")
    got = model.state_dict()
    assert set(got) == set(ref) and "head.weight" in got and "bn.num_batches_tracked" in got
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []


def test_flat_param_refuses_differing_steps(tmp_path):
    """A flat parameter has one ``step``: per-param steps that differ are refused, naming both."""
    import unickpt
    from tests.workers.fsdp1_workers import CFG, load_expecting_error, make
    from unickpt.testing.toy import train_step

    model, optim, _ = make("torch", 0)
    train_step(model, optim, 0, CFG)
    optim.state[model.blocks[1].fc2.bias]["step"].fill_(5.0)
    ckpt = str(tmp_path / "steps")
    unickpt.save(ckpt, {"model": model, "optimizer": optim}, framework="torch").wait()
    ((flat, orig),) = run_ranks(load_expecting_error, 1, ["fsdp", "fsdp-orig"], ckpt)
    assert "optimizer.state.blocks.1.fc2.bias.step = 5.0" in flat and "use_orig_params=True" in flat
    assert orig == ""  # per-parameter steps fit use_orig_params=True
