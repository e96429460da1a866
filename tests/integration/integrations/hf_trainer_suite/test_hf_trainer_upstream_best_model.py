"""The best-model scenarios of transformers' ``tests/trainer/test_trainer_checkpointing.py``
(class ``TrainerBestModelTest``), at huggingface/transformers commit
22c22fa26f5f3352d243bc358f0947af05b1d61b, with a ``UnickptTrainer`` where upstream builds a
``Trainer``: ``save_strategy="best"``, ``load_best_model_at_end`` and ``save_total_limit``
rotation over checkpoints whose training state is a unickpt checkpoint. Each test names the
upstream test it follows; expected values are upstream's (the log history's best metric, the
best checkpoint's ``model.safetensors``, the Trainer's folder counts)."""

from __future__ import annotations

import os
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
import safetensors.torch
import torch
from transformers import TrainerState
from transformers.testing_utils import evaluate_side_effect_factory, get_steps_per_epoch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tests.integration.integrations.hf_trainer_suite.hf_trainer_suite_support import (
    LineModule,
    LinePreTrained,
    assert_unickpt_checkpoints,
    regression_trainer,
)

EPOCHS, BATCH = 3, 8  # TrainingArguments' defaults
TOTAL = EPOCHS * 64 // BATCH  # 24 steps


def almost_accuracy(eval_pred) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Upstream's ``AlmostAccuracy``: the share of predictions within 0.25 of the label."""
    predictions, labels = eval_pred
    return {"accuracy": float((np.abs(predictions - labels) <= 0.25).astype(np.float32).mean())}


def _assert_weights_are(trainer, checkpoint: str) -> None:  # type: ignore[no-untyped-def]
    saved = safetensors.torch.load_file(os.path.join(checkpoint, "model.safetensors"))
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, saved[name]), name


def _assert_best_model_loaded(output_dir: str, freq: int, trainer, metric: str, greater: bool, pretrained: bool):  # type: ignore[no-untyped-def]
    """Upstream's ``check_best_model_has_been_loaded``: the best evaluation of the last
    checkpoint's log history names the checkpoint whose weights the Trainer holds at the end."""
    last = os.path.join(output_dir, f"checkpoint-{TOTAL}")
    history = TrainerState.load_from_json(os.path.join(last, "trainer_state.json")).log_history
    values = [entry[metric] for entry in history if metric in entry]
    best = (max if greater else min)(values)
    steps = list(range(freq, TOTAL + 1, freq)) + ([TOTAL] if TOTAL % freq else [])
    checkpoint = os.path.join(output_dir, f"checkpoint-{steps[values.index(best)]}")
    if pretrained:
        model = LinePreTrained.from_pretrained(checkpoint)
    else:
        model = LineModule()
        model.load_state_dict(safetensors.torch.load_file(os.path.join(checkpoint, "model.safetensors")))
    torch.testing.assert_close(model.a, trainer.model.a)
    torch.testing.assert_close(model.b, trainer.model.b)
    assert trainer.evaluate()[metric] == best


# upstream TrainerBestModelTest.test_load_best_model_with_save_best
def test_load_best_model_with_save_best(tmp_path) -> None:
    trainer = regression_trainer(
        str(tmp_path),
        save_strategy="best",
        eval_strategy="steps",
        eval_steps=5,
        load_best_model_at_end=True,
        save_total_limit=2,
        max_steps=11,
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint is not None
    _assert_weights_are(trainer, trainer.state.best_model_checkpoint)


# upstream TrainerBestModelTest.test_load_best_model_with_save
def test_load_best_model_with_save(tmp_path) -> None:
    trainer = regression_trainer(str(tmp_path / "a"), save_steps=5, eval_strategy="steps", eval_steps=5, max_steps=9)
    trainer.train()
    assert os.path.isdir(os.path.join(str(tmp_path / "a"), "checkpoint-9"))  # the last step is saved

    output_dir = str(tmp_path / "b")
    trainer = regression_trainer(
        output_dir,
        save_steps=5,
        eval_strategy="steps",
        eval_steps=5,
        load_best_model_at_end=True,
        save_total_limit=2,
        max_steps=11,
    )
    trainer.train()
    assert os.path.isdir(os.path.join(output_dir, "checkpoint-11"))
    assert os.path.isdir(os.path.join(output_dir, "checkpoint-10"))
    assert not os.path.exists(os.path.join(output_dir, "checkpoint-5"))  # rotated away
    _assert_weights_are(trainer, trainer.state.best_model_checkpoint)


# upstream TrainerBestModelTest.test_save_best_checkpoint
@pytest.mark.parametrize(
    ("metric", "evaluations"),
    [
        ("accuracy", [(0.03, 0.60), (0.02, 0.65), (0.01, 0.64)]),
        ("loss", [(0.03, 0.60), (0.02, 0.65), (0.03, 0.66)]),
    ],
)
def test_save_best_checkpoint(tmp_path, metric: str, evaluations: list[tuple[float, float]]) -> None:
    trainer = regression_trainer(
        str(tmp_path),
        a=1.5,
        b=2.5,
        learning_rate=0.1,
        eval_strategy="epoch",
        save_strategy="best",
        metric_for_best_model=metric,
    )
    trainer.compute_metrics = almost_accuracy
    results = [
        {"eval_loss": loss, "eval_accuracy": accuracy, "epoch": float(i + 1)}
        for i, (loss, accuracy) in enumerate(evaluations)
    ]
    with patch.object(trainer, "_evaluate", side_effect=results):
        trainer.train()
    assert sorted(os.listdir(str(tmp_path))) == ["checkpoint-16", "checkpoint-8"]  # epochs 1 and 2 improved
    # unickpt: upstream's check_saved_checkpoints asks for optimizer.pt and scheduler.pt (here: unickpt/)
    assert_unickpt_checkpoints(str(tmp_path), range(8, TOTAL, 8))


# upstream TrainerBestModelTest.test_metric_for_best_model_behavior
def test_metric_for_best_model_behavior(tmp_path) -> None:
    with pytest.raises(ValueError, match="`args.metric_for_best_model` must be provided"):
        regression_trainer(str(tmp_path), eval_strategy="epoch", save_strategy="best")
    trainer = regression_trainer(
        str(tmp_path), eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True
    )
    assert trainer.args.metric_for_best_model == "loss"


def _with_evaluations(trainer, accuracies: list[float]) -> None:  # type: ignore[no-untyped-def]
    trainer.compute_metrics = almost_accuracy
    effect = evaluate_side_effect_factory([{"eval_accuracy": a} for a in accuracies])
    with patch.object(trainer, "_evaluate", side_effect=effect):
        trainer.train()


def _best_is_epoch_one(out: str, best: dict, **save: Any) -> Any:
    """Evaluation every epoch with metrics 0.59, 0.57, 0.55 (greater is better): the best is
    epoch 1, its checkpoint ``checkpoint-<steps of one epoch>``; returns the trained Trainer."""
    trainer = regression_trainer(out, eval_strategy="epoch", load_best_model_at_end=False, **save, **best)
    _with_evaluations(trainer, [0.59, 0.57, 0.55])
    steps_per_epoch = get_steps_per_epoch(trainer)
    assert trainer.state.best_metric == 0.59 and trainer.state.best_global_step == steps_per_epoch
    assert trainer.state.best_model_checkpoint == os.path.join(out, f"{PREFIX_CHECKPOINT_DIR}-{steps_per_epoch}")
    return trainer


# upstream TrainerBestModelTest.test_best_model_checkpoint_behavior (its six cases)
def test_best_model_checkpoint_behavior(tmp_path) -> None:
    best = {"metric_for_best_model": "accuracy", "greater_is_better": True}
    # 1. no evaluation, a checkpoint every step
    out = str(tmp_path / "1")
    trainer = regression_trainer(out, eval_strategy="no", save_strategy="steps", save_steps=1, **best)
    trainer.train()
    assert trainer.state.best_metric is None and trainer.state.best_model_checkpoint is None
    assert len(os.listdir(out)) == trainer.state.global_step

    # 2. no evaluation, save_total_limit=1: only the last checkpoint stays
    out = str(tmp_path / "2")
    trainer = regression_trainer(
        out, eval_strategy="no", save_strategy="steps", save_steps=1, save_total_limit=1, **best
    )
    trainer.train()
    assert trainer.state.best_metric is None and trainer.state.best_model_checkpoint is None
    assert os.listdir(out) == [f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"]

    # 3. evaluation and saving every epoch: the best is epoch 1
    trainer = _best_is_epoch_one(str(tmp_path / "3"), best, save_strategy="epoch")
    assert len(os.listdir(tmp_path / "3")) == trainer.state.num_train_epochs

    # 4. evaluation every epoch, a checkpoint every step
    trainer = _best_is_epoch_one(str(tmp_path / "4"), best, save_strategy="steps", save_steps=1)
    assert len(os.listdir(tmp_path / "4")) == trainer.state.global_step

    # 5. save_total_limit=1, the best at step 1: that checkpoint is the one kept
    out = str(tmp_path / "5")
    trainer = regression_trainer(
        out, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, save_total_limit=1, **best
    )
    _with_evaluations(trainer, [0.90, 0.80, 0.70])
    assert trainer.state.best_metric == 0.90 and trainer.state.best_global_step == 1
    assert trainer.state.best_model_checkpoint == os.path.join(out, f"{PREFIX_CHECKPOINT_DIR}-1")
    assert len(os.listdir(out)) == 1

    # 6. evaluation every 3 steps, saving every 2: the best step has no checkpoint
    out = str(tmp_path / "6")
    trainer = regression_trainer(out, eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=2, **best)
    _with_evaluations(trainer, [0.90, 0.80, 0.70])
    assert trainer.state.best_metric == 0.90 and trainer.state.best_global_step == 3
    assert trainer.state.best_model_checkpoint is None
    assert len(os.listdir(out)) == trainer.state.global_step // 2


# upstream TrainerBestModelTest.test_load_best_model_at_end and test_load_best_model_from_safetensors
@pytest.mark.parametrize(
    ("metric", "per_epoch", "pretrained"),
    [
        ("eval_loss", False, True),
        ("eval_accuracy", False, True),
        ("eval_accuracy", True, True),
        ("eval_loss", False, False),
    ],
)
def test_load_best_model_at_end(tmp_path, metric: str, per_epoch: bool, pretrained: bool) -> None:
    schedule = (
        {"eval_strategy": "epoch", "save_strategy": "epoch"}
        if per_epoch
        else {"eval_strategy": "steps", "eval_steps": 5, "save_steps": 5}
    )
    accuracy = {"metric_for_best_model": "accuracy"} if metric == "eval_accuracy" else {}
    trainer = regression_trainer(
        str(tmp_path),
        a=1.5,
        b=2.5,
        learning_rate=0.1,
        load_best_model_at_end=True,
        pretrained=pretrained,
        **schedule,
        **accuracy,
    )
    if accuracy:
        trainer.compute_metrics = almost_accuracy
    assert trainer.args.greater_is_better == bool(accuracy)
    trainer.train()
    freq = 64 // BATCH if per_epoch else 5
    # unickpt: upstream's check_saved_checkpoints asks for optimizer.pt and scheduler.pt (here: unickpt/)
    assert_unickpt_checkpoints(str(tmp_path), range(freq, TOTAL, freq), pretrained=pretrained)
    _assert_best_model_loaded(str(tmp_path), freq, trainer, metric, bool(accuracy), pretrained)
