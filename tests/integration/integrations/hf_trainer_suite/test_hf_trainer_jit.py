"""A just-in-time checkpoint (``TrainingArguments(enable_jit_checkpoint=True)``: after SIGTERM the
Trainer's ``CheckpointManager`` marks ``checkpoint-N`` incomplete, calls ``_save_checkpoint`` and
unmarks it) taken for real through ``UnickptTrainer``. Upstream's ``JITCheckpointTest``
(transformers ``tests/trainer/test_trainer_checkpointing.py``) mocks ``_save_checkpoint`` and the
signal timer, so no checkpoint is written there; here the request comes as the kill-wait timer's
would (``is_checkpoint_requested``), without a signal. Found with it: with
``unickpt_async_save`` the save returned before it committed, so the folder was unmarked while
still incomplete, right before the job is killed."""

from __future__ import annotations

import os

import pytest
from transformers import TrainerCallback
from transformers.trainer_jit_checkpoint import JITCheckpointCallback

from tests.integration.integrations.hf_trainer_suite.hf_trainer_suite_support import (
    has_unickpt_checkpoint,
    regression_trainer,
    weights,
)
from unickpt.integrations import hf_trainer
from unickpt.integrations.hf_trainer import UnickptTrainer

INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"  # transformers' CheckpointManager writes it


class _RequestJitCheckpointAt(TrainerCallback):
    """At the end of step ``step``: what the kill-wait timer does after SIGTERM."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.trainer: UnickptTrainer | None = None

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            assert self.trainer is not None
            jit = next(cb for cb in self.trainer.callback_handler.callbacks if isinstance(cb, JITCheckpointCallback))
            jit.jit_manager.is_checkpoint_requested = True


def test_jit_checkpoint_commits_before_the_trainer_unmarks_it(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(UnickptTrainer, "unickpt_async_save", True)
    saves: list[tuple[str, bool]] = []
    real_save = hf_trainer.save

    def recording_save(path: str, state, async_save: bool = False, **kwargs):  # type: ignore[no-untyped-def]
        saves.append((os.path.basename(os.path.dirname(path)), async_save))
        return real_save(path, state, async_save=async_save, **kwargs)

    monkeypatch.setattr(hf_trainer, "save", recording_save)
    out = str(tmp_path / "jit")
    request = _RequestJitCheckpointAt(3)
    trainer = regression_trainer(out, save_steps=2, enable_jit_checkpoint=True, callbacks=[request])
    request.trainer = trainer  # type: ignore[assignment]
    trainer.train()

    # the JIT checkpoint (taken before step 4's optimizer step) commits before it returns; the
    # Trainer's own saves (every 2 steps, until training stops) stay asynchronous
    assert [folder for folder, async_save in saves if not async_save] == ["checkpoint-3"]
    assert ("checkpoint-2", True) in saves
    assert trainer.state.global_step < 24  # the JIT checkpoint stopped training
    jit_checkpoint = os.path.join(out, "checkpoint-3")
    assert has_unickpt_checkpoint(jit_checkpoint)
    assert not os.path.exists(os.path.join(jit_checkpoint, INCOMPLETE_MARKER))

    # resumed from it, training ends where an uninterrupted run ends
    uninterrupted = regression_trainer(str(tmp_path / "uninterrupted"), save_strategy="no")
    uninterrupted.train()
    resumed = regression_trainer(str(tmp_path / "resumed"), save_strategy="no")
    resumed.train(resume_from_checkpoint=jit_checkpoint)
    assert weights(resumed) == weights(uninterrupted)
