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
  checkpoints; synchronously where the rotation right after it would delete the newest
  committed checkpoint while this one is still being written (``_commits_before_return``:
  ``save_total_limit=1``; ``save_total_limit=2`` with the best checkpoint older than the
  previous save), where the Trainer deletes this one at the end of ``train()``, and for a
  just-in-time checkpoint (``enable_jit_checkpoint``: the job is about to be killed));
  ``_save_scaler`` / ``_save_rng_state`` have nothing left to do; then the Trainer writes
  ``trainer_state.json`` and rotates (``save_total_limit``).
* ``train(resume_from_checkpoint=...)``: ``_load_from_checkpoint`` (before ``accelerator.prepare``)
  skips the weights of a folder holding a unickpt checkpoint; after ``prepare``,
  ``_load_optimizer_and_scheduler`` loads the model, optimizer, scheduler, scaler and the rest in
  place (a buffer the model grew goes through its own ``load_state_dict``, as in the Trainer's
  own weight load: ``RestoreOptions(resize_plain_tensors=True)``), resharded to this job's
  world size, and keeps the RNG states, which ``_load_rng_state`` sets where the Trainer sets
  its own. A folder without ``unickpt/`` (a stock checkpoint) goes
  the Trainer's own way. A folder whose ``unickpt/`` holds no committed checkpoint (a save
  interrupted before its commit) raises ``IncompleteCheckpointError`` (data files there) or
  ``NotACheckpointError``, naming the newest ``checkpoint-N`` beside it that did commit: never
  the Trainer's own load, which would find no ``optimizer.pt`` and go on with a fresh optimizer
  and scheduler. ``resume_from_checkpoint=True`` (the Trainer's ``get_last_checkpoint``: the
  highest-numbered folder, committed or not) raises the same when that folder is uncommitted
  rather than falling back to an older one: left in place, the uncommitted folder would still
  count in the Trainer's rotation (by step number where modification times are unreliable it
  stays "the newest", which rotation always keeps, and the resumed run's committed saves go
  first) and a later save of the same step would write into it; deleting it, with the
  Trainer's files in it, is not unickpt's to do. Move it away and resume again.
  Opt-in, for jobs restarted without a person (``unickpt_resume_fallback = True`` on the class
  or the instance): ``resume_from_checkpoint=True`` resumes from the newest ``checkpoint-N`` that
  committed instead (a warning names the folder it skipped); it moves, renames and deletes
  nothing. The folders it skips stay numbered above the resumed step, and the rotation counts
  them and keeps the highest one as "the newest": every save while such a folder exists
  commits before ``_save_checkpoint`` returns (``_commits_before_return``), so a rotation never
  leaves only uncommitted checkpoints; the resumed run's save at a skipped step replaces that
  folder's files with a committed checkpoint. A folder given by path raises as before.
* ``train`` returns (or raises) after waiting for the pending asynchronous save.

Fast recovery (``unickpt_fast_root = "shm://<job>"`` on the class or the instance, with
``unickpt_replicas``, ``unickpt_durable_every``, ``unickpt_keep_fast``, ``unickpt_durable_root``;
docs/guide/recovery.md): the training state goes to a ``TieredCheckpointManager`` (each host's
RAM, copied to ``unickpt_replicas`` other hosts, every ``unickpt_durable_every``-th step also to
the durable folder, by default ``<output_dir>/unickpt-tier``) as step ``state.global_step``, and
``checkpoint-N`` gets ``unickpt-tier.json`` (``integrations._tier``: the path -> step map)
instead of ``unickpt/``. A resume from such a folder (``resume_from_checkpoint=True`` picks the
highest, as ever) loads step N through the tier's ``load_latest`` (own RAM, peers' RAM, durable
folder) and raises ``IncompleteCheckpointError`` naming the tier's newest recoverable step when
that is not N. The Trainer's rotation deletes the folders (the marker with them); the tier keeps
its own retention. The Trainer still writes ``trainer_state.json`` and the model's weights
(``save_model``) into each folder.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import TYPE_CHECKING, Any

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .. import PerRank, default_checkpointer, load, save, set_rng_state
from ..errors import ConfigurationError, IncompleteCheckpointError, NotACheckpointError
from ..format.records import METADATA_FILE
from ..ops.inspect import load_metadata
from ..options import LoadOptions, RestoreOptions
from ._tier import MARKER_NAME, TierKnobs, load_step, read_step_marker, write_step_marker
from .accelerate import RngState, accelerate_state

__all__ = ["UnickptTrainerMixin", "UnickptTrainer", "UNICKPT_SUBDIR"]

UNICKPT_SUBDIR = "unickpt"  # the unickpt checkpoint inside each checkpoint-N folder
# a buffer the model grew goes through the model's own load_state_dict, as in the Trainer's own load
_RESUME_OPTIONS = LoadOptions(restore=RestoreOptions(resize_plain_tensors=True))
# what transformers' CheckpointManager writes in checkpoint-N while a just-in-time save runs
_JIT_INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"
_CHECKPOINT_N = re.compile(re.escape(PREFIX_CHECKPOINT_DIR) + r"-([0-9]+)")  # the Trainer's folder names


def _same_path(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _newest_committed_beside(checkpoint: str) -> str | None:
    """The highest-numbered other ``checkpoint-N`` beside ``checkpoint`` whose ``unickpt/``
    holds committed metadata (for the error message only)."""
    parent = os.path.dirname(os.path.abspath(checkpoint))
    try:
        names = os.listdir(parent)
    except OSError:
        return None
    found = [
        (int(m.group(1)), name)
        for name in names
        if (m := _CHECKPOINT_N.fullmatch(name))
        and not _same_path(os.path.join(parent, name), checkpoint)
        and os.path.isfile(os.path.join(parent, name, UNICKPT_SUBDIR, METADATA_FILE))
    ]
    return os.path.join(parent, max(found)[1]) if found else None


def _committed(path: str) -> bool:
    """Whether the unickpt checkpoint ``path`` committed (``_require_committed`` without raising)."""
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return True
    if not os.path.isdir(path):
        return False
    try:
        load_metadata(path)  # also finds a version an interrupted publication moved aside
    except (IncompleteCheckpointError, NotACheckpointError):
        return False
    return True


def _numbered_checkpoints(parent: str) -> list[tuple[int, str]]:
    """The Trainer's ``checkpoint-N`` folders in ``parent``: (N, path), highest first."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    found = [(int(m.group(1)), os.path.join(parent, n)) for n in names if (m := _CHECKPOINT_N.fullmatch(n))]
    return sorted((f for f in found if os.path.isdir(f[1])), reverse=True)


def _fallback_checkpoint(last: str) -> str | None:
    """For ``unickpt_resume_fallback``: ``last`` (the Trainer's ``get_last_checkpoint``) when it
    is a stock checkpoint or committed, else the newest ``checkpoint-N`` beside it that committed
    (None: none did)."""
    path = os.path.join(last, UNICKPT_SUBDIR)
    if not os.path.lexists(path) or _committed(path):
        return last
    for _, folder in _numbered_checkpoints(os.path.dirname(os.path.abspath(last))):
        inner = os.path.join(folder, UNICKPT_SUBDIR)
        if os.path.isdir(inner) and _committed(inner):
            return folder
    return None


def _require_committed(checkpoint: str, path: str) -> None:
    """Raise unless the unickpt checkpoint ``path`` inside the Trainer's ``checkpoint`` folder
    committed (module docstring: never the Trainer's own load of half a checkpoint)."""
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return  # committed (the common case, no read)
    try:
        load_metadata(path)  # also finds a version an interrupted publication moved aside
        return
    except (IncompleteCheckpointError, NotACheckpointError) as e:
        cause, kind = e, type(e)
    newest = _newest_committed_beside(checkpoint)
    advice = (
        f"the newest checkpoint beside it that committed is {newest}: move {checkpoint} out of "
        f"{os.path.dirname(os.path.abspath(checkpoint))} (train(resume_from_checkpoint=True) picks the "
        f"highest-numbered folder, and save_total_limit counts it) and resume from {newest}"
        if newest is not None
        else "no checkpoint-N beside it holds a committed unickpt checkpoint"
    )
    raise kind(
        f"cannot resume from {checkpoint}: its save never committed ({path} holds no committed unickpt "
        f"checkpoint: the save was interrupted before its commit, or its {METADATA_FILE} was removed), so the "
        f"optimizer, scheduler and RNG states are not there; {advice} ({cause})"
    ) from None


if TYPE_CHECKING:  # what the mixin is mixed into
    _Base = Trainer
else:
    _Base = object


class UnickptTrainerMixin(_Base):
    """Put before ``Trainer`` in the bases (module docstring)."""

    unickpt_async_save: bool = False  # a class attribute: set it on your subclass or the instance
    # resume_from_checkpoint=True skips a newest checkpoint-N whose save never committed (a kill
    # during an asynchronous save) for the newest that did, with a warning; off: it raises
    unickpt_resume_fallback: bool = False
    _unickpt_previous_save: str | None = None  # the checkpoint-N folder this trainer saved last
    # fast recovery (module docstring): "shm://<job>" turns the RAM tier on
    unickpt_fast_root: str = ""
    unickpt_replicas: int = 1
    unickpt_durable_every: int | None = None
    unickpt_keep_fast: int = 2
    unickpt_durable_root: str | None = None  # None: <output_dir>/unickpt-tier
    _unickpt_tier: Any = None  # the TieredCheckpointManager while train() runs
    unickpt_last_recovery: Any = None  # the tier's RecoveryReport of the last resume

    def _unickpt_tiers(self) -> Any:
        """The tier (made on every rank at the first save or resume of a ``train``), or None when off."""
        knobs = TierKnobs(self.unickpt_fast_root, self.unickpt_durable_root, self.unickpt_replicas,
                          self.unickpt_durable_every, self.unickpt_keep_fast)  # fmt: skip
        if not knobs.on:
            return None
        if self._unickpt_tier is None:
            self._unickpt_tier = knobs.build(os.path.join(self.args.output_dir or os.getcwd(), "unickpt-tier"))
        return self._unickpt_tier

    def _unickpt_tier_step(self, checkpoint: str | None) -> int | None:
        """The tier step ``checkpoint-N`` names (its ``unickpt-tier.json``), or None."""
        return None if checkpoint is None else read_step_marker(os.path.join(checkpoint, MARKER_NAME))

    def _unickpt_own(self, checkpoint: str | None) -> bool:
        """Whether unickpt loads ``checkpoint`` (the tier's marker, or ``unickpt/``)."""
        return self._unickpt_tier_step(checkpoint) is not None or self._unickpt_path(checkpoint) is not None

    def _unickpt_path(self, checkpoint: str | None) -> str | None:
        """``checkpoint/unickpt`` when it holds a committed unickpt checkpoint; None for a folder
        without ``unickpt/`` (a stock checkpoint); raises for one whose save never committed."""
        if checkpoint is None:
            return None
        path = os.path.join(checkpoint, UNICKPT_SUBDIR)
        if not os.path.lexists(path):
            return None
        _require_committed(checkpoint, path)
        return path

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

        * it is a just-in-time checkpoint (``enable_jit_checkpoint``, after SIGTERM): the
          Trainer's ``CheckpointManager`` marks the folder incomplete (each rank writes the
          marker before its own save) and unmarks it when ``_save_checkpoint`` returns, and the
          job is about to be killed;
        * the Trainer deletes it at the end of ``train()`` without waiting for anything:
          ``save_total_limit=1`` and a best checkpoint elsewhere;
        * the rotation right after this save (``transformers.trainer_utils.rotate_checkpoints``)
          may delete the previous checkpoint, the newest committed one, while this one is not
          committed: rotation keeps the newest folder (this one) and the best, and deletes the
          oldest others down to ``save_total_limit``, so the previous one goes when the limit is
          at most the number it keeps that way (1, or 2 with a best checkpoint elsewhere), unless
          the previous one is the best. Before this trainer's first save the previous one is not
          known (one of an earlier job): then it commits too.
        * a ``checkpoint-M`` numbered above this one is there (left by a run this one resumed
          before: ``unickpt_resume_fallback``, or a resume from an older folder given by path):
          rotation by step number keeps it as "the newest" and counts it, so the previous
          checkpoint may go while this one is not committed.
        Only arguments, ``TrainerState`` and the output folder's ``checkpoint-N`` names decide,
        the same on every rank."""
        if os.path.exists(os.path.join(output_dir, _JIT_INCOMPLETE_MARKER)):
            return True
        if self._unickpt_higher_folder(output_dir):
            return True  # the rotation keeps that one as "the newest" and may delete the previous one
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return False
        best = self.state.best_model_checkpoint
        best_elsewhere = best is not None and not _same_path(best, output_dir)
        if limit == 1 and best_elsewhere:
            return True
        if limit > 1 + best_elsewhere:
            return False  # rotation keeps the previous one
        previous = self._unickpt_previous_save
        return not (best is not None and best_elsewhere and previous is not None and _same_path(previous, best))

    def _unickpt_higher_folder(self, output_dir: str) -> bool:
        m = _CHECKPOINT_N.fullmatch(os.path.basename(os.path.normpath(output_dir)))
        if m is None:
            return False
        here = int(m.group(1))
        return any(n > here for n, _ in _numbered_checkpoints(os.path.dirname(os.path.abspath(output_dir))))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        tiers = self._unickpt_tiers()
        if tiers is not None:  # the tier's step, and the folder's marker naming it (rank 0)
            step = int(self.state.global_step)
            tiers.save(step, self._unickpt_state(RngState()), async_save=self.unickpt_async_save)
            if self.args.process_index == 0:
                write_step_marker(os.path.join(output_dir, MARKER_NAME), step)
            self._unickpt_previous_save = output_dir
            return
        default_checkpointer().wait()  # the previous save commits before the Trainer may rotate it away
        path = os.path.join(output_dir, UNICKPT_SUBDIR)
        async_save = self.unickpt_async_save and not self._commits_before_return(output_dir)
        save(path, self._unickpt_state(RngState()), async_save=async_save)
        self._unickpt_previous_save = output_dir

    def _save_scaler(self, output_dir: str) -> None:
        pass  # in the unickpt checkpoint

    def _save_rng_state(self, output_dir: str) -> None:
        pass  # in the unickpt checkpoint

    # ---------------------------------------------------------------- load

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._unickpt_own(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: the weights load after accelerator.prepare, with the optimizer

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        step = self._unickpt_tier_step(checkpoint)
        if step is not None:
            tiers = self._unickpt_tiers()
            if tiers is None:
                raise ConfigurationError(
                    f"{checkpoint} names step {step} of a RAM tier: set unickpt_fast_root (and the tier's other "
                    "options) as when it was saved to resume from it"
                )
            rng = RngState(apply=False)
            assert checkpoint is not None
            load_step(tiers, step, checkpoint, self._unickpt_state(rng), options=_RESUME_OPTIONS)
            self.unickpt_last_recovery = tiers.last_recovery
            self._unickpt_rng = rng.loaded
            return
        path = self._unickpt_path(checkpoint)
        if path is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        rng = RngState(apply=False)
        state = self._unickpt_state(rng)
        load(path, state, options=_RESUME_OPTIONS)
        self._unickpt_rng = rng.loaded

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._unickpt_own(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._unickpt_own(checkpoint):
            super()._load_rng_state(checkpoint)
            return
        loaded = getattr(self, "_unickpt_rng", None)
        if loaded is not None:
            set_rng_state(loaded)

    def _unickpt_resume_target(self, resume_from_checkpoint: Any) -> Any:
        """``resume_from_checkpoint`` as ``train`` passes it on: with ``unickpt_resume_fallback``,
        ``True`` becomes the newest committed ``checkpoint-N`` when the highest one never committed."""
        if not (self.unickpt_resume_fallback and resume_from_checkpoint is True):
            return resume_from_checkpoint
        out = self.args.output_dir
        last = get_last_checkpoint(out) if out is not None and os.path.isdir(out) else None
        if last is None:
            return resume_from_checkpoint  # the Trainer's own error: nothing to resume from
        chosen = _fallback_checkpoint(last)
        if chosen is None:
            return last  # nothing committed: _require_committed raises, naming the folder
        if not _same_path(chosen, last):
            warnings.warn(
                f"resuming from {chosen}, the newest checkpoint that committed: {last} and any newer folder "
                "hold a save that never committed (unickpt_resume_fallback=True); they stay in place, "
                "and this run's save at their step replaces them",
                stacklevel=3,
            )
        return chosen

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        resume_from_checkpoint = self._unickpt_resume_target(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            tiers, self._unickpt_tier = self._unickpt_tier, None
            try:
                if tiers is not None:
                    tiers.close()  # the replications and durable copies done (or raised); RAM stays
            finally:
                default_checkpointer().wait()  # the last asynchronous save commits (or raises)


class UnickptTrainer(UnickptTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints hold a unickpt checkpoint (module docstring)."""
