"""unickpt's own regression tests beside the Trainer's: checkpoints whose unickpt save has not
committed, with the real Trainer.

* Resume: a ``checkpoint-N`` whose ``unickpt/`` holds no committed checkpoint (the job died
  before an asynchronous save committed; its metadata removed) raises a unickpt error naming the
  folder and the newest committed one beside it, for ``resume_from_checkpoint=True`` (the Trainer
  picks the highest-numbered folder) and for the folder given. It used to go the stock
  Trainer's way: no ``optimizer.pt`` there, so training went on with a fresh optimizer and
  scheduler without a word.
* Rotation: with ``unickpt_async_save`` the Trainer rotates (``save_total_limit``) right after
  ``_save_checkpoint``'s save returns. Each asynchronous commit is held here until the test has
  looked at what the rotation left: the newest committed checkpoint from before the save must
  still be there whenever the new one has not committed (``save_total_limit=1`` used to delete
  it, and ``save_total_limit=2`` with an older best checkpoint too)."""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any

import pytest
from transformers import TrainerCallback

import unickpt
from tests.integration.integrations.hf_trainer_suite.hf_trainer_suite_support import (
    has_unickpt_checkpoint,
    regression_trainer,
    weights,
)
from unickpt.engine.save import pipeline
from unickpt.errors import IncompleteCheckpointError, NotACheckpointError
from unickpt.format.records import METADATA_FILE
from unickpt.integrations import hf_trainer
from unickpt.integrations.hf_trainer import UNICKPT_SUBDIR, UnickptTrainer

# ---------------------------------------------------------------- resume


@pytest.mark.parametrize(
    ("damage", "error"),
    [("metadata removed", IncompleteCheckpointError), ("nothing written", NotACheckpointError)],
)
def test_resume_from_an_uncommitted_checkpoint_raises(tmp_path, damage: str, error: type[Exception]) -> None:
    out = str(tmp_path / "run")
    regression_trainer(out, save_steps=2, max_steps=4).train()
    newest, committed = os.path.join(out, "checkpoint-4"), os.path.join(out, "checkpoint-2")
    unickpt_dir = os.path.join(newest, UNICKPT_SUBDIR)
    if damage == "metadata removed":  # data files there, no commit
        os.remove(os.path.join(unickpt_dir, METADATA_FILE))
    else:  # the folder made, nothing in it yet
        shutil.rmtree(unickpt_dir)
        os.mkdir(unickpt_dir)
    assert os.path.isfile(os.path.join(newest, "trainer_state.json"))  # the Trainer's own files are all there

    for resume in (True, newest):
        trainer = regression_trainer(out, save_steps=2, max_steps=6, a=5.0)
        with pytest.raises(error) as raised:
            trainer.train(resume_from_checkpoint=resume)
        message = str(raised.value)
        assert newest in message and "never committed" in message, message
        assert committed in message, message  # what to resume from instead
        assert trainer.state.global_step == 0 and weights(trainer) == (5.0, 0.0)  # nothing trained

    # the newest committed one still resumes
    resumed = regression_trainer(out, save_steps=2, max_steps=6, a=5.0)
    resumed.train(resume_from_checkpoint=committed)
    assert resumed.state.global_step == 6


# ---------------------------------------------------------------- rotation


class _HeldCommits:
    """Holds each asynchronous save's commit (its worker waits in ``commit_stage``) from the
    moment ``hf_trainer`` starts it until ``release``; records each save as (folder, async)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.open.set()
        self.saves: list[tuple[str, bool]] = []
        real_commit, real_save = pipeline.commit_stage, hf_trainer.save

        def held_commit(*args: Any, **kwargs: Any) -> Any:
            self.open.wait()
            return real_commit(*args, **kwargs)

        def recording_save(path: str, state: Any, async_save: bool = False, **kwargs: Any) -> Any:
            self.saves.append((os.path.basename(os.path.dirname(path)), async_save))
            if async_save:
                self.open.clear()
            return real_save(path, state, async_save=async_save, **kwargs)

        monkeypatch.setattr(pipeline, "commit_stage", held_commit)
        monkeypatch.setattr(hf_trainer, "save", recording_save)

    def release(self) -> None:
        self.open.set()


def _committed_checkpoints(out: str) -> list[str]:
    if not os.path.isdir(out):
        return []
    found = [(int(n.split("-")[1]), n) for n in os.listdir(out) if n.startswith("checkpoint-")]
    return [os.path.join(out, n) for _, n in sorted(found) if has_unickpt_checkpoint(os.path.join(out, n))]


class _RotationWatch(UnickptTrainer):
    """Looks, after each ``_save_checkpoint`` (the save, then the Trainer's rotation), before the
    held commit goes on: ``lost`` lists (step, folder) where the newest committed checkpoint from
    before the save is gone while this save has not committed; ``uncommitted`` the steps seen
    uncommitted there."""

    held: _HeldCommits
    lost: list[tuple[int, str]]
    uncommitted: list[int]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        unickpt.wait_all()  # the previous save commits (the mixin waits for it here anyway)
        before = _committed_checkpoints(self.args.output_dir)
        try:
            super()._save_checkpoint(model, trial)
            step = self.state.global_step
            if not has_unickpt_checkpoint(os.path.join(self.args.output_dir, f"checkpoint-{step}")):
                self.uncommitted.append(step)
                if before and not os.path.isdir(before[-1]):
                    self.lost.append((step, before[-1]))
        finally:
            self.held.release()  # never leave a commit held (train() waits for it)


# (TrainingArguments, the saves that may stay asynchronous: rotation cannot delete the newest committed one)
_BEST_IS_FIRST = {  # eval loss falls as it trains: "greater is better" keeps checkpoint-2 the best
    "eval_strategy": "steps",
    "eval_steps": 2,
    "metric_for_best_model": "loss",
    "greater_is_better": True,
    "load_best_model_at_end": True,
}
ROTATIONS = {
    "limit 1": ({"save_total_limit": 1}, set()),
    "limit 1, best first": ({"save_total_limit": 1, **_BEST_IS_FIRST}, set()),
    "limit 2, best first": ({"save_total_limit": 2, **_BEST_IS_FIRST}, {"checkpoint-2", "checkpoint-4"}),
    "limit 2": ({"save_total_limit": 2}, {"checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"}),
}


@pytest.mark.parametrize("case", ROTATIONS)
def test_rotation_keeps_the_newest_committed_checkpoint(tmp_path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    args, may_stay_async = ROTATIONS[case]
    monkeypatch.setattr(UnickptTrainer, "unickpt_async_save", True)
    held = _HeldCommits(monkeypatch)
    out = str(tmp_path / "run")
    trainer = regression_trainer(out, trainer_class=_RotationWatch, save_steps=2, max_steps=8, **args)
    trainer.held, trainer.lost, trainer.uncommitted = held, [], []  # type: ignore[attr-defined]
    trainer.train()

    assert trainer.lost == [], trainer.lost  # type: ignore[attr-defined]
    # the hold worked: every asynchronous save was looked at before it committed
    assert trainer.uncommitted == [int(f.split("-")[1]) for f, a in held.saves if a]  # type: ignore[attr-defined]
    assert {f for f, a in held.saves if a} == may_stay_async, held.saves  # async where rotation cannot hurt
    assert all(has_unickpt_checkpoint(c) for c in (os.path.join(out, n) for n in os.listdir(out)))


# ---------------------------------------------------------------- opt-in fallback (issue 39 item 22)


def _kill_during_async_save(out: str, step: int) -> None:
    """What a kill during ``checkpoint-<step>``'s asynchronous save leaves: the Trainer's files,
    unickpt's data files, no commit."""
    os.remove(os.path.join(out, f"checkpoint-{step}", UNICKPT_SUBDIR, METADATA_FILE))


def test_issue39_item22_resume_fallback_to_the_newest_committed_checkpoint(tmp_path) -> None:
    out = str(tmp_path / "run")
    regression_trainer(out, save_steps=2, max_steps=6).train()
    _kill_during_async_save(out, 6)
    _kill_during_async_save(out, 4)  # two interrupted saves in a row: the fallback goes past both
    ref = str(tmp_path / "ref")
    shutil.copytree(os.path.join(out, "checkpoint-2"), os.path.join(ref, "checkpoint-2"))

    # off by default: the auto-restarted job raises, as before, every time
    with pytest.raises(IncompleteCheckpointError):
        regression_trainer(out, save_steps=2, max_steps=8).train(resume_from_checkpoint=True)

    trainer = regression_trainer(out, save_steps=2, max_steps=8)
    trainer.unickpt_resume_fallback = True  # type: ignore[attr-defined]
    seen: list[int] = []
    trainer.add_callback(_StepLog(seen))
    with pytest.warns(UserWarning, match="checkpoint-2, the newest checkpoint that committed"):
        trainer.train(resume_from_checkpoint=True)
    assert seen[0] == 3 and trainer.state.global_step == 8  # resumed after step 2, not from scratch
    # the skipped folders were replaced by this run's committed saves at their steps
    assert [has_unickpt_checkpoint(os.path.join(out, f"checkpoint-{s}")) for s in (2, 4, 6, 8)] == [True] * 4
    # the same as a resume from checkpoint-2 given by path (a copy taken before this run)
    again = regression_trainer(ref, save_steps=2, max_steps=8)
    again.train(resume_from_checkpoint=os.path.join(ref, "checkpoint-2"))
    assert weights(trainer) == weights(again)


def test_issue39_item22_fallback_with_nothing_committed_still_raises(tmp_path) -> None:
    out = str(tmp_path / "run")
    regression_trainer(out, save_steps=2, max_steps=2).train()
    _kill_during_async_save(out, 2)
    trainer = regression_trainer(out, save_steps=2, max_steps=4)
    trainer.unickpt_resume_fallback = True  # type: ignore[attr-defined]
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        trainer.train(resume_from_checkpoint=True)


def test_issue39_item22_rotation_after_a_fallback_keeps_a_committed_checkpoint(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The skipped folders (checkpoint-7, checkpoint-8) stay numbered above the resumed run's
    saves: rotation keeps checkpoint-8 as "the newest" and counts it, so an asynchronous save at
    step 7 would leave checkpoint-6, the only committed one, to be deleted while step 7 is not
    committed yet."""
    out = str(tmp_path / "run")
    regression_trainer(out, save_steps=1, max_steps=8).train()
    _kill_during_async_save(out, 7)
    _kill_during_async_save(out, 8)
    monkeypatch.setattr(UnickptTrainer, "unickpt_async_save", True)
    held = _HeldCommits(monkeypatch)
    trainer = regression_trainer(out, trainer_class=_RotationWatch, save_steps=1, max_steps=9, save_total_limit=2)
    trainer.held, trainer.lost, trainer.uncommitted = held, [], []  # type: ignore[attr-defined]
    trainer.unickpt_resume_fallback = True  # type: ignore[attr-defined]
    with pytest.warns(UserWarning, match="checkpoint-6"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.lost == [], trainer.lost  # type: ignore[attr-defined]
    # while checkpoint-8 was the uncommitted leftover, saves committed before returning
    assert [(f, a) for f, a in held.saves if f == "checkpoint-7"] == [("checkpoint-7", False)], held.saves
    assert ("checkpoint-9", True) in held.saves  # and went back to asynchronous after it was replaced
    assert all(has_unickpt_checkpoint(c) for c in (os.path.join(out, n) for n in os.listdir(out)))


class _StepLog(TrainerCallback):
    """Records the global step at the end of each step."""

    def __init__(self, seen: list[int]) -> None:
        self.seen = seen

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen.append(state.global_step)
