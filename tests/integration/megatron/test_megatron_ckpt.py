"""``framework="megatron"``: checkpoints of megatron-core GPT models (TP, PP, DP, virtual PP,
the distributed optimizer) load into any other split bit-exact, model and optimizer state, and
the next training step matches the uninterrupted job's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAVE_MEGATRON = importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not installed")

if HAVE_MEGATRON:
    from tests.workers.harness import calls_in_turn, run_ranks
    from tests.workers.loader_data import all_tokens, write_dataset
    from tests.workers.megatron_ckpt_workers import (
        careless_job,
        consolidate_job,
        hf_job,
        load_job,
        loader_job,
        megatron_to_neox,
        save_job,
    )

LOSS_TOL = 1e-5  # other reduction orders at another layout (see test_megatron_env)
MODEL_ATOL = 1e-4  # weights after one more Adam step at another layout


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for name, t in a.items():
        assert t.dtype == b[name].dtype and torch.equal(t, b[name]), f"{what} {name} differs"


def check_resumed(
    saved: dict, got: list[dict], same_layout: bool = False, loss_tol: float = LOSS_TOL, atol: float | None = MODEL_ATOL
) -> None:
    """The loaded model and optimizer state equal the saved ones bit for bit; the next step's
    loss (and, with ``atol``, the weights after it) match the uninterrupted job's."""
    ref = saved[0]
    _equal(got[0]["model"], ref["model"], "model")
    assert got[0]["optim"].keys() == ref["optim"].keys()
    for name, fields in ref["optim"].items():
        _equal(got[0]["optim"][name], fields, f"optimizer {name}")
    for res in got:
        if same_layout:
            assert res["loss"] == ref["loss"]
        else:
            assert abs(res["loss"] - ref["loss"]) < loss_tol, (res["loss"], ref["loss"])
    if atol is None:
        return
    for name, t in ref["after"].items():
        torch.testing.assert_close(got[0]["after"][name], t, atol=0 if same_layout else atol, rtol=0)


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory):
    """TP2 x PP2 with the distributed optimizer (4 ranks), saved after one step."""
    path = str(tmp_path_factory.mktemp("megatron") / "tp2pp2")
    return path, run_ranks(save_job, 4, path, 2, 2, 1, True)


TP2PP2_LAYOUTS = [
    pytest.param((1, 1, 1, False, None), id="tp1pp1-1rank-fp32opt"),
    pytest.param((1, 1, 2, True, None), id="tp1pp1dp2-distopt"),
    pytest.param((1, 1, 4, True, None), id="tp1pp1dp4-distopt"),
    pytest.param((1, 2, 1, True, None), id="tp1pp2-distopt"),
    pytest.param((4, 1, 1, True, None), id="tp4-distopt"),
    pytest.param((1, 2, 2, True, 2), id="tp1pp2dp2-vp2-distopt"),
]
DP2_LAYOUTS = [
    pytest.param((1, 1, 1), id="dp1"),
    pytest.param((1, 1, 4), id="dp4"),
    pytest.param((2, 2, 1), id="tp2pp2"),
]
VOCABS = [80, 48]


@pytest.fixture(scope="module")
def loads(tp2pp2, dp2, tmp_path_factory) -> _ByWorldSize:
    """Every job that only loads the tp2pp2 or dp2 checkpoint (and the careless-use job), one
    spawn per world size (``calls_in_turn``), each in a later job than the save, run when a test
    first asks for one of that size. ``loads[key]``: per-rank results; the keys are the tests'."""
    tp2pp2_path, dp2_path = tp2pp2[0], dp2[0]
    jobs: dict = {"careless": (1, careless_job, [str(tmp_path_factory.mktemp("careless") / "ck")])}
    # key -> (world size, function, arguments), run in this order within a world size
    for p in TP2PP2_LAYOUTS:
        tp, pp, dp, dist_opt, vp = p.values[0]
        jobs[("tp2pp2", p.values[0])] = (tp * pp * dp, load_job, [tp2pp2_path, tp, pp, dp, dist_opt, vp])
    jobs["tp2pp2-same"] = (4, load_job, [tp2pp2_path, 2, 2, 1, True, None, False, True])
    for p in DP2_LAYOUTS:
        tp, pp, dp = p.values[0]
        jobs[("dp2", p.values[0])] = (tp * pp * dp, load_job, [dp2_path, tp, pp, dp, True])
    for world, fsdp2 in ((1, False), (2, True)):
        jobs[("consolidate", fsdp2)] = (world, consolidate_job, [tp2pp2_path, fsdp2])
    jobs["fp32-into-bf16"] = (2, load_job, [dp2_path, 1, 1, 2, True, None, True, False, "megatron", True])
    jobs["hf"] = (1, hf_job, [tp2pp2_path])
    for vocab in VOCABS:
        jobs[("vocab", vocab)] = (
            1,
            load_job,
            [tp2pp2_path, 1, 1, 1, True, None, False, False, "megatron", False, vocab],
        )
    return _ByWorldSize(jobs)


class _ByWorldSize:
    """``loads[key]``: the per-rank results of one job; the first key of a world size runs all of
    that size's jobs in one spawn (so the work spreads over the tests that ask)."""

    def __init__(self, jobs: dict) -> None:
        self.jobs, self.results = jobs, {}

    def __getitem__(self, key) -> list:
        if key not in self.results:
            world = self.jobs[key][0]
            keys = [k for k, (w, _, _) in self.jobs.items() if w == world]
            per_rank = run_ranks(calls_in_turn, world, [[self.jobs[k][1], self.jobs[k][2]] for k in keys], timeout=900)
            for i, k in enumerate(keys):
                self.results[k] = [r[i] for r in per_rank]
        return self.results[key]


@pytest.mark.parametrize(
    "layout",
    TP2PP2_LAYOUTS,
)
def test_tp2pp2_distopt_reshards(tp2pp2, loads, layout):
    _, saved = tp2pp2
    check_resumed(saved, loads[("tp2pp2", layout)])


def test_tp2pp2_resumes_at_the_same_layout_bit_exact(tp2pp2, loads):
    _, saved = tp2pp2
    check_resumed(saved, loads["tp2pp2-same"], same_layout=True)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    """TP1 x PP1 x DP2 with the distributed optimizer (2 ranks): ZeRO-1 ranges cut parameters."""
    path = str(tmp_path_factory.mktemp("megatron") / "dp2")
    return path, run_ranks(save_job, 2, path, 1, 1, 2, True)


@pytest.mark.parametrize("layout", DP2_LAYOUTS)
def test_dp2_distopt_reshards(dp2, loads, layout):
    _, saved = dp2
    check_resumed(saved, loads[("dp2", layout)])


def test_bf16_main_params_reshard_tp2_to_tp1_dp2(tmp_path):
    """bf16 parameters with fp32 main copies (distributed optimizer): the main params are saved
    (optimizer.main_params.*) and come back bit-exact at another split."""
    path = str(tmp_path / "bf16")
    saved = run_ranks(save_job, 2, path, 2, 1, 1, True, None, True)
    assert all(t.dtype == torch.bfloat16 for t in saved[0]["model"].values())
    got = run_ranks(load_job, 2, path, 1, 1, 2, True, None, True)
    # the state is bit-exact; the next step computes in bf16 at another split, so its loss is
    # close and Adam's first moves from the bf16 gradients are not compared
    check_resumed(saved, got, loss_tol=1e-3, atol=None)


@pytest.mark.parametrize("world,fsdp2", [pytest.param(1, False, id="plain-torch"), pytest.param(2, True, id="fsdp2")])
def test_tp2pp2_loads_into_a_plain_torch_model_by_module_names(tp2pp2, loads, world, fsdp2):
    """Consolidation for evaluation: the TP2xPP2 checkpoint loads into megatron's GPTModel used as
    a plain module (no megatron DDP or optimizer) and into FSDP2 over it, under the module's own
    names through LoadOptions(key_map=...) (megatron's sharded keys rename the layer norms), with
    a torch AdamW taking the saved moments and learning rate."""
    _, saved = tp2pp2
    got = loads[("consolidate", fsdp2)][0]
    assert len(loads[("consolidate", fsdp2)]) == world
    ref = saved[0]
    names = got["names"]  # megatron key -> module name
    assert any(k != v for k, v in names.items())  # renamed keys exist (layer norms)
    assert sorted(names) == sorted(ref["model"])
    for key, name in names.items():
        assert torch.equal(got["model"][name], ref["model"][key]), key
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optim"][name][field], ref["optim"][key][field]), (key, field)
    assert set(got["lr"].values()) == {0.01}  # megatron's lr, not the 0.5 the AdamW was built with


def test_dataloader_of_tp_rank0_first_stage_reshards_with_the_model(tmp_path):
    """TP2 x DP2 (loaders on TP rank 0 of each DP group) -> TP1 x PP2 (one loader, on the first
    stage, takes every part): every token is consumed exactly once across the save and the
    resumed job."""
    sources = write_dataset(str(tmp_path / "data"))
    path = str(tmp_path / "ck")
    before = run_ranks(loader_job, 4, path, 2, 1, 2, sources, "save")
    assert [bool(b) for b in before] == [True, False, True, False]  # ranks 0 and 2 own loaders
    after = run_ranks(loader_job, 2, path, 1, 2, 1, sources, "load")
    assert [bool(a) for a in after] == [True, False]  # the first stage: rank 0
    assert sorted(t for r in before + after for t in r) == all_tokens(sources)


def test_fp32_checkpoint_into_a_bf16_job_sets_main_params_from_the_model(dp2, loads):
    """A checkpoint without main copies (fp32 job) loads into a bf16 job with cast_dtypes: the
    model is the saved one rounded to bf16, Adam's moments are the saved ones, and the fp32
    main params follow the loaded model (megatron's reload_model_params)."""
    _, saved = dp2
    got = loads["fp32-into-bf16"][0]
    ref = saved[0]
    for key, t in ref["model"].items():
        assert torch.equal(got["model"][key], t.to(torch.bfloat16)), key
        assert torch.equal(got["optim"][key]["main_param"], t.to(torch.bfloat16).float()), key
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optim"][key][field], ref["optim"][key][field]), (key, field)


def test_careless_use_gets_clear_errors_and_torch_optimizers_work(loads):
    got = loads["careless"][0]
    assert got["detected"] == "megatron"  # framework="auto" finds megatron-core chunks
    assert "sharded_state_dict" in got["not_megatron"]
    assert "global shape" in got["other_shape"] and "the model differs" in got["other_shape"]
    assert got["adam_round_trip"]


def test_tp2pp2_loads_into_a_hugging_face_model_through_key_map(tp2pp2, loads):
    """Megatron's global keys map onto Hugging Face GPTNeoX names one to one (its fused QKV is
    interleaved per head like Megatron's): every HF tensor and its Adam moment is the saved one."""
    _, saved = tp2pp2
    got = loads["hf"][0]
    ref = saved[0]
    mapped = {megatron_to_neox(k): k for k in ref["model"] if megatron_to_neox(k) is not None}
    assert sorted(mapped) == sorted(got["model"])  # every HF tensor comes from the checkpoint
    for hf, key in mapped.items():
        assert torch.equal(got["model"][hf], ref["model"][key]), hf
        assert torch.equal(got["exp_avg"][hf], ref["optim"][key]["exp_avg"]), hf


@pytest.mark.parametrize("vocab", VOCABS)
def test_padded_vocabulary_of_another_size_loads_the_rows_both_have(tp2pp2, loads, vocab):
    """Megatron pads the vocabulary to a multiple of the TP size, so another TP size can have
    another row count in the embeddings and output layer (``allow_shape_mismatch``): the rows
    both have load bit-exact, extra live rows keep their values with zero Adam state, saved rows
    the job lacks are left out; every other tensor loads as usual."""
    _, saved = tp2pp2
    got = loads[("vocab", vocab)][0]
    ref = saved[0]
    padded = {"embedding.word_embeddings.weight", "output_layer.weight"}
    n = min(vocab, 64)
    for key, t in ref["model"].items():
        if key not in padded:
            assert torch.equal(got["model"][key], t), key
            continue
        assert got["model"][key].shape[0] == vocab
        assert torch.equal(got["model"][key][:n], t[:n]), key
        assert torch.equal(got["model"][key][n:], got["initial"][key][n:]), key
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optim"][key][field][:n], ref["optim"][key][field][:n]), (key, field)
            assert not got["optim"][key][field][n:].any(), (key, field)


@pytest.mark.parametrize(
    "saved_ep,load",
    [
        pytest.param(2, (1, 1), id="ep2-to-ep1-1rank"),
        pytest.param(1, (2, 2), id="ep1-to-ep2"),
    ],
)
def test_moe_expert_parallel_reshards(tmp_path, saved_ep, load):
    """A MoE GPT (4 SequentialMLP experts per layer, top-1 routing, the distributed optimizer for
    dense and expert parameters: a chain of two) moves between expert-parallel sizes bit-exact,
    with the same next-step loss."""
    path = str(tmp_path / "moe")
    saved = run_ranks(save_job, 2, path, 1, 1, 2, True, None, False, {"num_moe_experts": 4, "ep": saved_ep})
    assert any(".mlp.experts." in k for k in saved[0]["model"])
    dp, ep = load
    moe = {"num_moe_experts": 4, "ep": ep}
    got = run_ranks(load_job, dp, path, 1, 1, dp, True, None, False, False, "megatron", False, 64, moe)
    check_resumed(saved, got)


def test_swiglu_fc1_saved_in_parts_reshards_tp2_to_dp2(tmp_path):
    """A SwiGLU model: megatron saves each TP rank's ``linear_fc1`` ([gate rows; up rows]) as two
    parts of the global [gate; up] tensor (a ShardedTensorFactory). TP2 -> TP1 x DP2 with the
    distributed optimizer, whose ZeRO ranges cut across the parts: bit-exact, same next step."""
    path = str(tmp_path / "swiglu")
    saved = run_ranks(save_job, 2, path, 2, 1, 1, True, None, False, {"gated": True})
    got = run_ranks(load_job, 2, path, 1, 1, 2, True, None, False, False, "megatron", False, 64, {"gated": True})
    check_resumed(saved, got)
