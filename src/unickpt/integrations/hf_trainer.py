"""The Hugging Face ``Trainer`` with its training state checkpointed through unickpt: every rank
saves its own shards, and ``resume_from_checkpoint`` works at any number of processes.

    from unickpt.integrations.hf_trainer import UnickptTrainer     # or UnickptTrainerMixin

    trainer = UnickptTrainer(model=model, args=args, train_dataset=ds)   # was: Trainer(...)
    trainer.train(resume_from_checkpoint=True)

``UnickptTrainerMixin`` goes before ``Trainer`` (or a subclass of it: ``class MyTrainer(
UnickptTrainerMixin, SFTTrainer)``); ``UnickptTrainer`` is ``Trainer`` with it. Each
``checkpoint-N`` folder the Trainer writes keeps what the Trainer writes there itself
(``trainer_state.json``, ``training_args.bin``, the model's ``config.json`` and weights from
``save_model``: what ``from_pretrained`` reads), and the rest of the training state goes to the
unickpt checkpoint ``checkpoint-N/unickpt`` instead of ``optimizer.pt``, ``scheduler.pt``,
``scaler.pt`` and ``rng_state_<rank>.pth``. ``save_total_limit``, ``save_steps`` /
``save_strategy`` and ``resume_from_checkpoint=True`` (the highest ``checkpoint-N``) are the
Trainer's own.

What the Trainer calls, in its order, and what the mixin does there:

* ``_save_checkpoint``: ``save_model`` (the Trainer's), then ``_save_optimizer_and_scheduler``:
  every rank saves ``unickpt.integrations.accelerate.accelerate_state`` (model, optimizer,
  stateful dataloaders, scaler, registered objects, per-rank RNG) plus ``lr_scheduler`` to
  ``checkpoint-N/unickpt`` (``unickpt_async_save=True``: returns once the snapshot is taken,
  after waiting for the previous save, so the Trainer's rotation only ever deletes committed
  checkpoints; synchronously where the Trainer deletes this one at the end of ``train()``
  (``save_total_limit=1`` with a best checkpoint elsewhere) and for a just-in-time checkpoint
  (``enable_jit_checkpoint``: the job is about to be killed)); ``_save_scaler`` /
  ``_save_rng_state`` have nothing left to do; then the Trainer writes ``trainer_state.json``
  and rotates (``save_total_limit``).
* ``train(resume_from_checkpoint=...)``: ``_load_from_checkpoint`` (before ``accelerator.prepare``)
  skips the weights of a folder holding a unickpt checkpoint; after ``prepare``,
  ``_load_optimizer_and_scheduler`` loads the model, optimizer, scheduler, scaler and the rest in
  place (a buffer the model grew goes through its own ``load_state_dict``, as in the Trainer's
  own weight load: ``RestoreOptions(resize_plain_tensors=True)``), resharded to this job's
  world size, and keeps the RNG states, which ``_load_rng_state`` sets where the Trainer sets
  its own. A folder without ``unickpt/`` (a stock checkpoint) goes
  the Trainer's own way.
* ``train`` returns (or raises) after waiting for the pending asynchronous save.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from transformers import Trainer

from .. import PerRank, default_checkpointer, load, save, set_rng_state
from ..format.records import METADATA_FILE
from ..options import LoadOptions, RestoreOptions
from .accelerate import RngState, accelerate_state

__all__ = ["UnickptTrainerMixin", "UnickptTrainer", "UNICKPT_SUBDIR"]

UNICKPT_SUBDIR = "unickpt"  # the unickpt checkpoint inside each checkpoint-N folder
# a buffer the model grew goes through the model's own load_state_dict, as in the Trainer's own load
_RESUME_OPTIONS = LoadOptions(restore=RestoreOptions(resize_plain_tensors=True))
# what transformers' CheckpointManager writes in checkpoint-N while a just-in-time save runs
_JIT_INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"

if TYPE_CHECKING:  # what the mixin is mixed into
    _Base = Trainer
else:
    _Base = object


class UnickptTrainerMixin(_Base):
    """Put before ``Trainer`` in the bases (module docstring)."""

    unickpt_async_save: bool = False  # a class attribute: set it on your subclass or the instance

    def _unickpt_path(self, checkpoint: str | None) -> str | None:
        if checkpoint is None:
            return None
        path = os.path.join(checkpoint, UNICKPT_SUBDIR)
        return path if os.path.isfile(os.path.join(path, METADATA_FILE)) else None

    def _unickpt_state(self, rng: RngState) -> dict[str, Any]:
        state = accelerate_state(self.accelerator)
        state["rng"] = PerRank(rng)
        scheduler = self.lr_scheduler
        prepared = [getattr(s, "scheduler", s) for s in self.accelerator._schedulers]
        if scheduler is not None and not any(
            scheduler is s or getattr(scheduler, "scheduler", None) is s for s in prepared
        ):
            state["lr_scheduler"] = scheduler
        return state

    # ---------------------------------------------------------------- save

    def _commits_before_return(self, output_dir: str) -> bool:
        """Whether the save to ``output_dir`` must commit before ``_save_optimizer_and_scheduler``
        returns, even with ``unickpt_async_save`` (the same on every rank):

        * the Trainer deletes it at the end of ``train()`` without waiting for anything:
          ``save_total_limit=1`` and a best checkpoint elsewhere;
        * it is a just-in-time checkpoint (``enable_jit_checkpoint``, after SIGTERM): the
          Trainer's ``CheckpointManager`` marks the folder incomplete (each rank writes the
          marker before its own save) and unmarks it when ``_save_checkpoint`` returns, and the
          job is about to be killed."""
        best = self.state.best_model_checkpoint
        if self.args.save_total_limit == 1 and best is not None:
            if os.path.abspath(best) != os.path.abspath(output_dir):
                return True
        return os.path.exists(os.path.join(output_dir, _JIT_INCOMPLETE_MARKER))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        default_checkpointer().wait()  # the previous save commits before the Trainer may rotate it away
        path = os.path.join(output_dir, UNICKPT_SUBDIR)
        async_save = self.unickpt_async_save and not self._commits_before_return(output_dir)
        save(path, self._unickpt_state(RngState()), async_save=async_save)

    def _save_scaler(self, output_dir: str) -> None:
        pass  # in the unickpt checkpoint

    def _save_rng_state(self, output_dir: str) -> None:
        pass  # in the unickpt checkpoint

    # ---------------------------------------------------------------- load

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._unickpt_path(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: the weights load after accelerator.prepare, with the optimizer

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        path = self._unickpt_path(checkpoint)
        if path is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        rng = RngState(apply=False)
        state = self._unickpt_state(rng)
        load(path, state, options=_RESUME_OPTIONS)
        self._unickpt_rng = rng.loaded

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._unickpt_path(checkpoint) is None:
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._unickpt_path(checkpoint) is None:
            super()._load_rng_state(checkpoint)
            return
        loaded = getattr(self, "_unickpt_rng", None)
        if loaded is not None:
            set_rng_state(loaded)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            default_checkpointer().wait()  # the last asynchronous save commits (or raises)


class UnickptTrainer(UnickptTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints hold a unickpt checkpoint (module docstring)."""
