"""Resume flows users hit, in real gloo processes (issue 10): rollback into the live job,
step-0 checkpoints and parameters without optimizer state, pipeline-style jobs whose ranks hold
different parameters, DDP buffers that differ across replicas, refused loads that change
nothing, dtype casts while loading.

Each spawn runs several cases (process starts dominate the cost); each case is its own test.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.workers.harness import calls_in_turn, run_ranks
from tests.workers.resume_workers import (
    STAGE_GROUPS,
    STAGE_LAYERS,
    Stage,
    absent_state,
    cast_load,
    ddp_buffers,
    pipeline_stages,
    pipelining_stages,
    refused_flat_step,
    rollback,
    stage_optimizer,
    stage_step,
    torch_optimizer_state,
)

ROLLBACK_WS3 = ["fsdp", "fsdp-orig", "fsdp2", "ddp"]  # ws=3: FSDP1 ranks own empty slices
ROLLBACK_WS2 = ["dtensor", "fsdp-orig"]
ABSENT = [(f, k) for f in ("fsdp2", "fsdp", "fsdp-orig") for k in ("adam", "adamw", "sgd")]


@pytest.fixture(scope="module")
def ws3(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume3")
    return run_ranks(rollback, 3, ROLLBACK_WS3, str(root))


@pytest.fixture(scope="module")
def ws2_jobs(tmp_path_factory):
    """One ws=2 spawn for every ws=2 case of this file: the rollback (dtensor), absent-state and
    DDP-buffer cases, the refused flat step and the forwarded cast (their checkpoints saved here
    first), torch pipelining, and the pipeline stages (last: it ends with a refused save).
    Returns ``(folders, {case: per-rank results}, the fp32 checkpoint's state dict)``."""
    import unickpt
    from tests.workers.fsdp1_workers import CFG
    from tests.workers.fsdp1_workers import make as make_spec
    from unickpt.testing.toy import ToyTransformer, train_step

    root = str(tmp_path_factory.mktemp("resume2"))
    dirs = {name: f"{root}/{name}" for name in ("cases", "steps", "fp32", "pipelining", "pipeline")}
    for name in ("cases", "pipelining", "pipeline"):  # each case's own folder (its tmp_path before)
        os.mkdir(dirs[name])
    # refused flat step: FSDP1 flat parameters keep one step, this checkpoint's steps differ
    model, optim, _ = make_spec("torch", 0)
    train_step(model, optim, 0, CFG)
    optim.state[model.blocks[1].fc2.bias]["step"].fill_(5.0)
    unickpt.save(dirs["steps"], {"model": model, "optimizer": optim}, framework="torch").wait()
    # forwarded cast: an fp32 checkpoint
    torch.manual_seed(0)
    fp32 = ToyTransformer(CFG)
    unickpt.save(dirs["fp32"], {"model": fp32}, framework="torch").wait()
    calls = [
        [_ws2_cases, [dirs["cases"]]],
        [refused_flat_step, [dirs["steps"]]],
        [cast_load, [dirs["fp32"]]],
        [pipelining_stages, [dirs["pipelining"]]],
        [pipeline_stages, [dirs["pipeline"]]],
    ]
    per_rank = run_ranks(calls_in_turn, 2, calls, timeout=600)
    names = ["cases", "refused_flat_step", "cast_load", "pipelining", "pipeline"]
    return dirs, {name: [r[i] for r in per_rank] for i, name in enumerate(names)}, fp32.state_dict()


@pytest.fixture(scope="module")
def ws2(ws2_jobs):
    """The rollback (dtensor), absent-state and DDP-buffer cases (in ``ws2_jobs``'s spawn)."""
    return ws2_jobs[1]["cases"]


def _ws2_cases(rank: int, ws: int, root: str) -> dict:
    return {
        "rollback": rollback(rank, ws, ROLLBACK_WS2, f"{root}/rollback"),
        "absent": absent_state(rank, ws, ABSENT, f"{root}/absent"),
        "ddp_buffers": ddp_buffers(rank, ws, root),
    }


def _check_rollback(per_rank: list[dict]) -> None:
    for rank, r in enumerate(per_rank):
        assert r["error"] == "", f"rank {rank}: {r['error']}"
        assert r["grads_untouched"], f"rank {rank}: the load changed gradients"
        assert not r["not_bit_exact"], f"rank {rank}: not the state at save: {r['not_bit_exact'][:8]}"
        assert r["groups_equal"], f"rank {rank}: param groups not rolled back"
        assert r["losses"] == r["uninterrupted"], (rank, r["losses"], r["uninterrupted"])


@pytest.mark.parametrize("spec", ROLLBACK_WS3)
def test_item1_rollback_into_live_job_ws3(ws3, spec):
    """Train, save, train on with gradients left set, load the old checkpoint into the same
    objects: bit-exact state at save, gradients untouched, the next steps as uninterrupted."""
    _check_rollback([r[spec] for r in ws3])


@pytest.mark.parametrize("spec", ROLLBACK_WS2)
def test_item1_rollback_into_live_job_ws2(ws2, spec):
    _check_rollback([r["rollback"][spec] for r in ws2])


def test_item1_rollback_into_live_job_torch(tmp_path):
    """ws=1 (no process group): the same rollback with plain torch."""
    res = rollback(0, 1, ["torch", "torch-sgd"], str(tmp_path))
    _check_rollback([res["torch"]])
    _check_rollback([res["torch-sgd"]])


@pytest.mark.parametrize("case", [f"{f}-{k}" for f, k in ABSENT])
def test_item6_absent_optimizer_state_stays_absent(ws2, case):
    """Step-0 checkpoints and never-updated parameters resume strictly, with no invented state:
    the resumed run matches the uninterrupted one bit for bit (Adam's bias correction included)."""
    for rank, r in enumerate(x["absent"][case] for x in ws2):
        assert "step0_error" not in r, f"rank {rank}: {r['step0_error']}"
        assert r["step0_state_empty"] and r["rollback_state_empty"], (rank, r)
        assert r["step0_losses"] and r["rollback_losses"], (rank, r)
        assert not r["step0_after"], (rank, r["step0_after"][:8])
        assert "unused_error" not in r, f"rank {rank}: {r['unused_error']}"
        assert r["unused_has_no_state"]
        assert not r["unused_loaded"], (rank, r["unused_loaded"][:8])
        assert r["unused_next_loss"]
        assert not r["unused_after_next"], (rank, r["unused_after_next"][:8])


def test_item8_ddp_buffers_from_the_broadcast_source(ws2):
    """BatchNorm statistics differ across DDP replicas at save; DDP broadcasts rank 0's at every
    forward, so the checkpoint must hold rank 0's: the resumed run's losses (evaluation losses
    use the running statistics) equal the uninterrupted run's bit for bit on every rank."""
    r0, r1 = (x["ddp_buffers"] for x in ws2)
    assert any(not torch.equal(r0["buffers"][k], r1["buffers"][k]) for k in r0["buffers"])  # replicas differ
    for rank, r in enumerate((r0, r1)):
        for k, v in r0["buffers"].items():
            assert torch.equal(r["loaded"][k], v), (rank, k)
        assert r["resumed"] == r["uninterrupted"], (rank, r["resumed"], r["uninterrupted"])


# ----------------------------------------------------------------------------- pipeline stages


@pytest.fixture(scope="module")
def pipeline(ws2_jobs):
    """``pipeline_stages`` (in ``ws2_jobs``'s spawn): its folder and per-rank results."""
    return ws2_jobs[0]["pipeline"], ws2_jobs[1]["pipeline"]


def test_item5_pipeline_stages_restore_their_own_param_groups(pipeline):
    """Two ranks hold different layers with different lr/betas/weight_decay (rank 0 with two
    groups): a same-layout strict resume gives each rank its own groups and state, bit-exact."""
    _, res = pipeline
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r["model_equal"] and r["next_loss_equal"], rank
        assert r["got"]["groups"] == r["ref"]["groups"], (rank, r["got"]["groups"], r["ref"]["groups"])
        want, got = r["ref"]["state"], r["got"]["state"]
        assert set(got) == set(want)
        for fqn in want:
            assert set(got[fqn]) == set(want[fqn])
            assert all(torch.equal(got[fqn][k], v) for k, v in want[fqn].items()), fqn


def test_item5_pipeline_checkpoint_into_one_process(pipeline):
    """The 2-stage checkpoint into one process holding every layer, one group per saved group:
    each group gets its stage's hyper-parameters; a group mixing stages is refused under strict."""
    import unickpt

    root, res = pipeline
    model = Stage(STAGE_LAYERS[0] + STAGE_LAYERS[1])
    groups = STAGE_GROUPS[0] + STAGE_GROUPS[1]
    optim = stage_optimizer(model, groups, defaults=True)
    unickpt.load(f"{root}/pipeline", {"model": model, "optimizer": optim}, framework="torch")
    got = torch_optimizer_state(model, optim)
    want_groups = res[0]["ref"]["groups"] + res[1]["ref"]["groups"]
    assert got["groups"] == want_groups
    for r in res:
        for fqn, st in r["ref"]["state"].items():
            assert all(torch.equal(got["state"][fqn][k], v) for k, v in st.items()), fqn
        for k, v in r["ref_model"].items():
            assert torch.equal(model.state_dict()[k], v), k
    mixed = stage_optimizer(model, [{"layers": STAGE_LAYERS[0] + STAGE_LAYERS[1]}], defaults=True)
    with pytest.raises(unickpt.FrameworkError, match="different hyper-parameters") as info:
        unickpt.load(f"{root}/pipeline", {"model": model, "optimizer": mixed}, framework="torch")
    assert "layers.0.weight" in str(info.value) and "layers.1.weight" in str(info.value)
    with pytest.warns(UserWarning, match="different hyper-parameters"):
        unickpt.load(f"{root}/pipeline", {"model": model, "optimizer": mixed}, framework="torch", strict=False)
    assert mixed.param_groups[0]["lr"] == STAGE_GROUPS[0][0]["lr"]  # its first parameter's group
    stage_step(model, mixed, 3)


def test_item5_ranks_disagreeing_on_hyperparameters_refused(pipeline):
    _, res = pipeline
    for r in res:
        msg = r["disagree_error"]
        assert "PlanningError" in msg and "rank 0" in msg and "rank 1" in msg, msg
        assert "layers.0.weight" in msg and "lr" in msg


# ----------------------------------------------------------------------------- refused loads, casts


def test_item2_refused_flat_step_changes_nothing(ws2_jobs):
    """FSDP1 flat parameters keep one step: a checkpoint with differing per-parameter steps (saved
    by ``ws2_jobs``) is refused on every rank before anything is applied, into trained and fresh
    optimizers."""
    for rank, r in enumerate(ws2_jobs[1]["refused_flat_step"]):
        for label in ("trained", "fresh"):
            assert "use_orig_params=True" in r[label]["error"], (rank, label, r[label])
            assert not r[label]["changed"], (rank, label, r[label]["changed"][:8])
            before, after = r[label]["state_entries"]
            assert before == after, (rank, label)


def test_item10_cast_dtypes_forwarded_reads_bit_exact(ws2_jobs):
    """fp32 checkpoint (saved by ``ws2_jobs``) -> bf16 DDP replicas (each saved byte read once and
    forwarded): every tensor equals torch's own ``.to(torch.bfloat16)`` of the saved one."""
    want = {k: v.to(torch.bfloat16) for k, v in ws2_jobs[2].items()}
    for got in ws2_jobs[1]["cast_load"]:
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k


def test_item5_torch_pipelining_two_stages(ws2_jobs):
    """A real ``torch.distributed.pipelining`` job (GPipe, 2 stages on gloo, in ``ws2_jobs``'s
    spawn): each stage resumes strictly with its own hyper-parameters and state, and the next
    step's loss is unchanged."""
    res = ws2_jobs[1]["pipelining"]
    assert [r["lr"] for r in res] == [1e-2, 4e-3]
    for rank, r in enumerate(res):
        assert r["groups_equal"] and r["state_equal"] and r["next_loss_equal"], (rank, r)
