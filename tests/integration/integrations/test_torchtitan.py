"""``UnickptCheckpointManager`` with torchtitan's real model (llama3 debug config, two layers),
optimizer and LR scheduler containers and dataloader, driven in its trainer's call order
(torchtitan_workers.py): saved at ws=2 with FSDP2 (async, interval 2, keep_latest_k 2), resumed
bit-exact at ws=2 (dataloader included), at ws=3 (FSDP2) and at ws=1 (plain module, in this
process); ``load_step``, ``exclude_from_loading``, ``initial_load_path`` (model only) and the
last-step model-only save (in ``export_dtype``); retention around the last-step save against
torchtitan's own DCP ``CheckpointManager`` driven alike in the ws=2 processes; ``load_only`` and
``enable_first_step_checkpoint``. Expected values are the saving ranks' own tensors
(``full_tensor``) or torchtitan's, never read back through unickpt. One spawn per world size."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer")
pytest.importorskip("triton")  # torchtitan's models import it (its CPU install lacks it otherwise)

from tests.support.compare import assert_same_tree
from tests.workers.harness import run_ranks
from tests.workers.torchtitan_workers import (
    SAVE_STEPS,
    build,
    forward_loss,
    load_ws3,
    manager_for,
    save_ws2,
    sd_adapter,
    snapshot,
    train_step,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("titan"))
    return root, run_ranks(save_ws2, 2, root, timeout=600)


def test_save_ws2_async_retention_and_resume_same_ws(saved) -> None:
    _, outs = saved
    r0 = outs[0]
    assert r0["fresh_load"] is False
    assert r0["folders"] == ["step-4", "step-6"]  # keep_latest_k=2 purged step-2
    st = r0["saved"]
    assert st["train_state"] == {"step": SAVE_STEPS, "ntokens_seen": SAVE_STEPS * 2 * 16}
    assert st["sched"][0][0] == SAVE_STEPS and st["optim"]  # real optimizer state was saved
    assert {v for v in st["lrs"].values()} == {st["sched"][0][1][0], st["sched"][0][1][1]}
    for out in outs:
        assert_same_tree(out["saved"], out["resumed_same_ws"], "ws2")
        assert_same_tree(out["next_batch"], out["resumed_next_batch"], "dataloader")
    assert outs[0]["next_batch"].tolist() != outs[1]["next_batch"].tolist()  # per-rank streams
    assert r0["final_files"] == ["step-7"]
    # no purge after the last-step save, as torchtitan's own DCP manager driven alike (saves at
    # 1, 2, 3, then 4 as the last step, keep_latest_k=2): step-1 purged, step-2 kept beside step-4
    kept = r0["kept"]
    for last in ("model", "full"):
        assert kept[f"keep_torchtitan_{last}"] == ["step-2", "step-3", "step-4"], kept
        assert kept[f"keep_unickpt_{last}"] == kept[f"keep_torchtitan_{last}"], kept


def test_resume_ws3_refuses_resized_loader_then_loads_bit_exact(saved) -> None:
    root, outs = saved
    for out in run_ranks(load_ws3, 3, root, timeout=600):
        assert "dataloader" in out["refused"] or "loader" in out["refused"], out["refused"]
        assert out["unchanged"]
        assert out["loaded_flag"] is True
        assert_same_tree(outs[0]["saved"], out["loaded"], "ws3")
        assert out["loss"] == outs[0]["saved_loss"]
        assert out["hf_flag"] is True  # the HF export read back at ws=3: the saved weights in bf16
        want = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in outs[0]["saved"]["params"].items()}
        assert_same_tree(want, out["hf_params"], "hf import")
    plain = build(os.path.join(root, "plain_bf16"))  # ws=1: the same weights, set by hand
    with torch.no_grad():
        for n, p in plain["model"].named_parameters():
            p.copy_(want[n])
    assert out["hf_loss"] == forward_loss(plain)
    plain["manager"].close()


def test_resume_ws1_knobs(saved) -> None:
    root, outs = saved
    t = build(root, exclude_from_loading=["dataloader"], load_only=True)
    assert t["manager"].load()
    assert_same_tree(outs[0]["saved"], snapshot(t), "ws1")
    assert forward_loss(t) == outs[0]["saved_loss"]
    # the last-step HF export (ws=2, FSDP2, bf16) equals torchtitan's adapter applied to the
    # model loaded here at ws=1; embeddings and lm_head also straight from the saving ranks
    from safetensors.torch import load_file

    from unickpt.ops.inspect import load_metadata

    folder = os.path.join(root, "final_hf", f"step-{SAVE_STEPS + 1}")
    assert sorted(os.listdir(folder)) == ["model.safetensors", "model.safetensors.index.json"]
    hf = load_file(os.path.join(folder, "model.safetensors"))
    want = sd_adapter(t).to_hf({k: v.to(torch.bfloat16) for k, v in t["model"].state_dict().items()})
    assert_same_tree({k: v.contiguous() for k, v in want.items()}, hf, "hf")
    saved = outs[0]["saved"]["params"]
    assert torch.equal(hf["model.embed_tokens.weight"], saved["tok_embeddings.weight"].to(torch.bfloat16))
    assert torch.equal(hf["lm_head.weight"], saved["lm_head.weight"].to(torch.bfloat16))
    assert t["manager"].load(step=4) and t["train_state"].step == 4
    with pytest.raises(FileNotFoundError):
        t["manager"].load(step=2)  # purged
    t["manager"].close()
    # initial_load_path (model only) from the last-step model-only save, the folder empty
    fresh = os.path.join(root, "fresh")
    final = os.path.join(root, "final", f"step-{SAVE_STEPS + 1}")
    _, md, _ = load_metadata(final)  # the last-step save holds the model only, in its dtype
    assert md.objects["state_keys"] == {"model": "module"} and not md.blobs
    assert sorted(md.tensors) == sorted(f"model.{n}" for n in saved)
    assert {r.dtype for r in md.tensors.values()} == {"float32"}
    t = build(fresh, initial_load_model_only=True, initial_load_path=final)
    assert t["manager"].load()
    got = snapshot(t)
    assert got["optim"] == {} and got["train_state"]["step"] == 0
    assert_same_tree(saved, got["params"], "initial load")
    t["manager"].close()
    # the model-only last save with export_dtype=bfloat16 (ws=2, FSDP2): the model's tensors
    # .to(bfloat16), as torchtitan's DCP manager wrote its own; both loaded here as initial loads
    # into float32 models (unickpt's, then torchtitan's manager reading its DCP folder)
    bf16 = os.path.join(root, "keep_unickpt_model", "step-4")
    _, md, _ = load_metadata(bf16)
    assert md.objects["state_keys"] == {"model": "module"} and not md.blobs
    assert {r.dtype for r in md.tensors.values()} == {"bfloat16"}
    want = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in saved.items()}
    t = build(os.path.join(root, "fresh_bf16"), initial_load_path=bf16)
    assert t["manager"].load()
    assert_same_tree(want, snapshot(t)["params"], "bf16 last save")
    t["manager"].close()
    from torchtitan.components.checkpointer import CheckpointManager

    theirs = build(os.path.join(root, "fresh_dcp"), keep_latest_k=0)
    theirs["manager"].close()
    dcp_bf16 = os.path.join(root, "keep_torchtitan_model", "step-4")
    theirs["manager"] = manager_for(
        theirs, os.path.join(root, "fresh_dcp"), CheckpointManager, keep_latest_k=0, initial_load_path=dcp_bf16
    )
    assert theirs["manager"].load()
    assert_same_tree(want, snapshot(theirs)["params"], "torchtitan's bf16 last save")
    theirs["manager"].close()


def test_config_refusals_and_lazy_import() -> None:
    import subprocess

    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    with pytest.raises(ValueError, match="last_save_model_only"):  # torchtitan's rule
        UnickptCheckpointManager.Config(enable=True, last_save_in_hf=True, last_save_model_only=False)
    with pytest.raises(ValueError, match="quantized"):
        UnickptCheckpointManager.Config(
            enable=True, initial_load_path="/x", initial_load_in_hf=True, initial_load_in_hf_quantized=True
        )
    with pytest.raises(ValueError, match="dataloader_on_resize"):
        UnickptCheckpointManager.Config(enable=True, dataloader_on_resize="modulo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 2 checkpoint"):  # torchtitan's own checks still run
        UnickptCheckpointManager.Config(enable=True, keep_latest_k=1)
    assert (
        UnickptCheckpointManager.Config(enable=False)
        .build(dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None)
        .load()
        is False
    )  # disabled: torchtitan's base class answers
    code = "import sys, unickpt; assert not [m for m in sys.modules if m.startswith('torchtitan')]"
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    )


def test_async_save_staging_waits_for_the_snapshot_only(tmp_path) -> None:
    """``maybe_wait_for_staging`` returns while the save's commit is held back (a listener on the
    worker blocks at ``save.commit.begin``): the trainer's next step does not wait for the write.
    It does wait for the snapshot: every parameter doubled in place right after it returns (the
    background copy of parameters and optimizer state would see that, or refuse it) leaves the
    checkpoint with the values of the save (half of them now, exact: a power of two)."""
    import threading

    t = build(str(tmp_path), async_mode="async", interval=1)
    reached, release = threading.Event(), threading.Event()

    def hold(ev: Any) -> None:
        if ev.phase == "save.commit.begin":
            reached.set()
            release.wait(120)

    t["manager"].checkpointer.events.add_listener(hold)
    try:
        train_step(t)  # saves step 1, async
        t["manager"].maybe_wait_for_staging()
        with torch.no_grad():
            for p in t["model"].parameters():
                p.mul_(2.0)
        assert reached.wait(120)  # the write is done, the commit held
        assert not t["manager"].save_future.done()
        assert not os.path.exists(os.path.join(str(tmp_path), "checkpoint", "step-1", "unickpt.metadata.json"))
    finally:
        release.set()
    t["manager"].maybe_wait_for_saving()
    assert t["manager"].save_future is None
    assert os.path.exists(os.path.join(str(tmp_path), "checkpoint", "step-1", "unickpt.metadata.json"))
    saved = {n: p.detach() / 2.0 for n, p in t["model"].named_parameters()}
    t["manager"].close()
    back = build(str(tmp_path), load_only=True)
    assert back["manager"].load()
    assert_same_tree(saved, snapshot(back)["params"], "snapshot")
    back["manager"].close()


def test_load_only_saves_nothing_and_first_step_checkpoint(tmp_path) -> None:
    """``load_only`` suppresses every save (the last step's too); ``enable_first_step_checkpoint``
    saves step 1 whatever the interval, then the interval rules."""
    folder = os.path.join(str(tmp_path), "checkpoint")
    t = build(str(tmp_path), load_only=True, interval=1)
    train_step(t)
    assert t["manager"].save(1) is False and t["manager"].save(2, last_step=True) is False
    assert not os.path.exists(folder)
    t["manager"].close()
    t = build(str(tmp_path), interval=3, enable_first_step_checkpoint=True)
    train_step(t)  # step 1: saved
    assert os.listdir(folder) == ["step-1"]
    assert t["manager"].save(2) is False and t["manager"].save(3) is True
    assert sorted(os.listdir(folder)) == ["step-1", "step-3"]
    t["manager"].close()
