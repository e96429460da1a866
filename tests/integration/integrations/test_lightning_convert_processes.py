"""Issue 39, items 12 and 13, with real processes: a Lightning user switching mid-project.

A real Trainer on 2 gloo processes with stock Lightning's ``DDPStrategy`` writes ``last.ckpt``;
``unickpt convert --from lightning`` imports it; a Trainer on 1 process with
``UnickptDDPStrategy`` resumes from the result (``fit(ckpt_path=OUT)``) and trains exactly as
stock Lightning resumed from the ``.ckpt`` itself (same spawn). The unickpt strategy given the
``.ckpt`` names the conversion. ``load_from_checkpoint`` builds the module from a unickpt
checkpoint saved by the 2 processes and loads it in 1."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")

from tests.workers.harness import run_ranks
from tests.workers.lightning_convert_workers import resume_converted, train_both
from unickpt.ops import convert


def test_issue39_item12_item13_ddp_ckpt_converted_resumes_like_stock_lightning(tmp_path) -> None:
    root = str(tmp_path)
    trained = run_ranks(train_both, 2, root, timeout=400)
    assert trained[0]["stock"] == trained[0]["unickpt"]  # both backends train alike
    converted = str(tmp_path / "converted")
    result = convert.from_lightning(os.path.join(root, "stock", "last.ckpt"), converted)
    assert "Lightning's trainer state" in result.layout

    [on1] = run_ranks(resume_converted, 1, root, converted, timeout=400)
    assert len(on1["stock"]) == 6  # epoch 1 at 1 process: 24 samples, batches of 4
    assert on1["unickpt"] == on1["stock"]
    assert on1["loaded_keys"] == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    assert "unickpt convert --from lightning" in on1["file"], on1["file"]

    # item 13: the module of the 2-process unickpt checkpoint, built from its hyper-parameters
    assert on1["hparams"] == {"fsdp": False, "fsdp1": False}
    assert on1["load_from_checkpoint"] == trained[0]["weights-unickpt"]
