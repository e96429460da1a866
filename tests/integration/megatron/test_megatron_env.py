"""The Megatron test bed itself (tests/workers/megatron_env.py): a tiny megatron-core GPTModel
on CPU/gloo builds the same full model at TP2xPP2 as at TP1xPP1, one train step gives the same
loss and state with the distributed optimizer (sharded over DP too) as with the plain one, and
megatron's ``sharded_state_dict()`` describes the tensors the oracle gathers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# "megatron.core", not "megatron": megatron-core ships ``megatron`` without an __init__.py (a
# folder named megatron on sys.path would be a portion of that namespace package)
HAVE_MEGATRON = importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not installed")

if HAVE_MEGATRON:
    from tests.workers.harness import run_ranks
    from tests.workers.megatron_workers import layout_run

LOSS_TOL = 1e-5
# one Adam step moves every weight by about lr * sign(grad): grads that differ in the last bits
# between layouts (other reduction orders) move weights by up to ~1e-5 differently
MODEL_ATOL = 1e-4
STATE_ATOL = 1e-6


@pytest.fixture(scope="module")
def reference():
    """TP1 x PP1 x DP1, megatron's plain FP32Optimizer (1 rank)."""
    return run_ranks(layout_run, 1, 1, 1, 1, False)


@pytest.fixture(scope="module")
def tp2pp2():
    """TP2 x PP2 x DP1 with the distributed optimizer (4 ranks), with the sharded_state_dict check."""
    return run_ranks(layout_run, 4, 2, 2, 1, True, None, True)


def _close(a: dict, b: dict, atol: float, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{what} {n}: {m}")


def test_same_seed_builds_the_same_full_model_at_tp2_pp2_and_tp1_pp1(reference, tp2pp2):
    ref, got = reference[0], tp2pp2[0]
    assert ref["inner_optimizers"] == ["FP32Optimizer"]
    assert got["inner_optimizers"] == ["DistributedOptimizer"]
    assert ref["initial"].keys() == got["initial"].keys()
    assert "decoder.layers.3.mlp.linear_fc2.weight" in ref["initial"]  # global layer numbers
    for name, t in ref["initial"].items():
        assert torch.equal(t, got["initial"][name]), name  # bit-equal: the init is a function of the name


def test_one_train_step_gives_the_same_loss_and_state(reference, tp2pp2):
    ref_loss = reference[0]["loss"]
    assert 3.0 < ref_loss < 5.0  # about ln(64): random tokens, near-uniform logits
    for rank, res in enumerate(tp2pp2):
        assert abs(res["loss"] - ref_loss) < LOSS_TOL, (rank, res["loss"], ref_loss)
    ref, got = reference[0], tp2pp2[0]
    _close(got["model"], ref["model"], MODEL_ATOL, "model")
    assert not all(torch.equal(ref["model"][n], ref["initial"][n]) for n in ref["model"])  # the step moved weights
    for field in ("exp_avg", "exp_avg_sq"):
        _close(
            {n: s[field] for n, s in got["optim"].items()},
            {n: s[field] for n, s in ref["optim"].items()},
            STATE_ATOL,
            field,
        )
    for name, state in got["optim"].items():  # fp32 params: the main param is the param
        assert torch.equal(state["main_param"], got["model"][name]), name


def test_a_full_state_loads_back_into_any_layout(reference, tp2pp2):
    for res in (reference[0], tp2pp2[0]):
        for name, t in res["initial"].items():
            assert torch.equal(res["reloaded"][name], t), name
            assert torch.equal(res["reloaded_main"][name], t), name


# 12 tensors per layer (stacked: one key each; per layer: 4 x 12 keys), plus embeddings (2),
# final layer norm (2) and output layer (1) in both forms; the optimizer's fully_reshardable
# form: 3 fields (param, exp_avg, exp_avg_sq) x the stacked keys
MODEL_KEYS = (12 + 5) + (4 * 12 + 5)
OPTIMIZER_KEYS = 3 * (12 + 5)


def _check_sharded_report(report: dict) -> None:
    assert report["problems"] == []
    assert report["global_tensors"] == MODEL_KEYS + OPTIMIZER_KEYS
    assert report["counts"]["stacked"] == report["counts"]["per_layer"] > 0
    for field in ("param", "exp_avg", "exp_avg_sq"):
        assert report["counts"][f"optimizer.{field}"] == report["counts"]["stacked"]


def test_sharded_state_dict_describes_the_oracle_tensors(tp2pp2):
    _check_sharded_report(tp2pp2[0]["sharded"])


def test_distributed_optimizer_sharded_over_dp_with_virtual_pipeline(reference):
    """TP1 x PP2 x DP2 with 2 virtual stages per rank: the optimizer state is split over the two
    DP ranks (a flat-buffer half each, parameters cut at the boundary) and gathers back."""
    got = run_ranks(layout_run, 4, 1, 2, 2, True, 2, True)
    _check_sharded_report(got[0]["sharded"])
    ref = reference[0]
    for rank, res in enumerate(got):
        assert abs(res["loss"] - ref["loss"]) < LOSS_TOL, (rank, res["loss"], ref["loss"])
    assert all(torch.equal(t, got[0]["initial"][n]) for n, t in ref["initial"].items())
    _close(got[0]["model"], ref["model"], MODEL_ATOL, "model")
    for field in ("exp_avg", "exp_avg_sq"):
        _close(
            {n: s[field] for n, s in got[0]["optim"].items()},
            {n: s[field] for n, s in ref["optim"].items()},
            STATE_ATOL,
            field,
        )


def test_cpu_patches_are_named_and_applied(reference):
    res = reference[0]
    names = res["patches"]
    assert len(names) == len(set(names)) >= 5
    assert res["cuda_current_device"] == "cpu"


def test_bf16_params_with_fp32_main_params():
    """bf16 parameters (megatron's Float16Module): Float16OptimizerWithFloat16Params at TP1 and
    the distributed optimizer sharded over DP2 keep fp32 main params; both step alike."""
    plain = run_ranks(layout_run, 1, 1, 1, 1, False, None, False, True)[0]
    dist = run_ranks(layout_run, 2, 1, 1, 2, True, None, False, True)
    assert plain["inner_optimizers"] == ["Float16OptimizerWithFloat16Params"]
    assert dist[0]["inner_optimizers"] == ["DistributedOptimizer"]
    for name, t in plain["initial"].items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, dist[0]["initial"][name]), name
    for res in dist:
        assert abs(res["loss"] - plain["loss"]) < 1e-3, (res["loss"], plain["loss"])
    for name, state in dist[0]["optim"].items():
        assert state["main_param"].dtype == torch.float32
        # the bf16 param is the rounded fp32 main param
        assert torch.equal(state["main_param"].to(torch.bfloat16), dist[0]["model"][name]), name
        torch.testing.assert_close(state["main_param"], plain["optim"][name]["main_param"], atol=MODEL_ATOL, rtol=0)
        assert torch.equal(dist[0]["reloaded_main"][name], dist[0]["initial"][name].float()), name
