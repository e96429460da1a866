"""Hugging Face Accelerate's ``save_state`` / ``load_state`` through unickpt: every rank saves its
own shards, and a checkpoint saved by N processes loads on any number of processes.

    from unickpt.integrations.accelerate import save_state, load_state

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    save_state(accelerator, "ckpt/step-1000")           # was: accelerator.save_state("ckpt/step-1000")
    load_state(accelerator, "ckpt/step-1000")           # was: accelerator.load_state("ckpt/step-1000")

Both are called on every rank, after ``accelerator.prepare`` (the objects they save and load are the
ones ``prepare`` registered). What they hand to unickpt mirrors ``Accelerator.save_state``
(accelerate 1.x), one key per object, as unickpt's open state (docs/state.md):

* ``model``, ``model_1``, ...: the prepared models, unwrapped from DDP (their parameters under the
  names the model reports; FSDP2 shards as DTensors), saved by every rank, resharded on load;
* ``optimizer``: the optimizers ``prepare`` wrapped (their inner optimizers), state keyed by
  parameter name;
* ``scheduler``, ``scheduler_1``, ...: the schedulers' ``state_dict()`` (replicated, saved once);
* ``dataloader`` (and ``dataloader_1``, ... per rank): prepared dataloaders made with
  ``DataLoaderConfiguration(use_stateful_dataloader=True)``; other dataloaders have no state
  (as in Accelerate: it saves only a seedable sampler of an iterable dataset, which is left out);
* ``scaler``: ``accelerator.scaler`` (fp16 ``GradScaler``), when there is one;
* ``custom_0``, ``custom_1``, ...: the objects of ``accelerator.register_for_checkpointing``
  (replicated: every rank must hold the same state, else ``RankDisagreementError``);
* ``rng``: each rank's python, numpy, torch (and CUDA) generator states (``unickpt.PerRank``:
  after a change of world size, rank r gets saved rank ``r % saved_world_size``'s, with a warning);
* ``accelerate``: ``accelerator.step`` (the gradient accumulation counter).

``load_state`` loads all of them in place (``strict`` per key: a registered object the checkpoint
lacks, or a saved one not registered now, raises unless ``strict=False``). ``save_state(...,
async_save=True)`` returns once the snapshot is taken; ``unickpt.wait_all()`` before the job
exits (``load_state`` waits for pending saves first). Both use unickpt's default checkpointer.

With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the folder is Accelerate's:
``save_state(accelerator)`` saves to ``<project_dir>/checkpoints/checkpoint_<iteration>`` (a folder
given is ignored, as by Accelerate; an existing one raises ``ValueError``), first removing the
oldest ``checkpoint_<n>`` beyond ``total_limit`` (rank 0, after this process's pending saves;
only unickpt's files go, ``_delete``), and ``load_state(accelerator)`` loads the highest-numbered
``checkpoint_<n>``.

Not supported (refused with ``TypeError``): DeepSpeed, Megatron-LM and XLA accelerators (they
save through their own engines) and ``register_save_state_pre_hook`` / ``load`` hooks (they edit
Accelerate's weight dicts, which unickpt does not build).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from .. import PerRank, SaveHandle, load, rng_state, save, set_rng_state, wait_all
from ..errors import NotACheckpointError, UnsupportedValueError
from ..options import LoadOptions
from ._delete import delete_checkpoint

__all__ = ["save_state", "load_state", "accelerate_state", "RngState"]

_REFUSED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


class RngState:
    """This rank's generator states (saved per rank, as Accelerate's ``random_states_<rank>.pkl``);
    ``apply=False``: a load keeps them in ``loaded`` (the Trainer sets them later, when it would)."""

    def __init__(self, apply: bool = True) -> None:
        self.apply = apply
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = dict(state)
        if self.apply:
            set_rng_state(self.loaded)


class _AcceleratorCounters:
    """``accelerator.step``, the same on every rank (replicated)."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        step = state.get("step")
        if not isinstance(step, int):
            raise UnsupportedValueError("state['accelerate'] holds no step counter")
        self.accelerator.step = step


def _suffixed(name: str, i: int) -> str:
    return name if i == 0 else f"{name}_{i}"


def accelerate_state(accelerator: Accelerator) -> dict[str, Any]:
    """The unickpt state ``save_state`` / ``load_state`` hand to unickpt (module docstring): the
    live objects ``accelerator.prepare`` and ``register_for_checkpointing`` registered."""
    kind = accelerator.distributed_type
    if kind in _REFUSED:
        raise TypeError(f"unickpt.integrations.accelerate does not support {kind} accelerators")
    if accelerator._save_model_state_pre_hook or accelerator._load_model_state_pre_hook:
        raise TypeError("unickpt.integrations.accelerate does not run save/load state pre-hooks")
    state: dict[str, Any] = {}
    fsdp1 = kind == DistributedType.FSDP and not accelerator.is_fsdp2
    models: list[Any] = []
    for prepared in accelerator._models:
        model = prepared if fsdp1 else accelerator.unwrap_model(prepared, keep_torch_compile=False)
        if not any(model is m for m in models):  # a model prepared twice is saved once
            models.append(model)
    for i, model in enumerate(models):
        state[_suffixed("model", i)] = model
    if accelerator._optimizers:
        state["optimizer"] = [getattr(opt, "optimizer", opt) for opt in accelerator._optimizers]
    for i, scheduler in enumerate(accelerator._schedulers):
        state[_suffixed("scheduler", i)] = getattr(scheduler, "scheduler", scheduler)
    loaders = [dl for dl in accelerator._dataloaders if getattr(dl, "use_stateful_dataloader", False)]
    for i, loader in enumerate(loaders):
        state[_suffixed("dataloader", i)] = loader if i == 0 else PerRank(loader)
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom_{i}"] = obj
    state["rng"] = PerRank(RngState())
    state["accelerate"] = _AcceleratorCounters(accelerator)
    return state


_NUMBERED = re.compile(r"checkpoint_([0-9]+)")  # Accelerate's automatic checkpoint names


def _numbered_checkpoints(accelerator: Accelerator) -> list[str]:
    """``<project_dir>/checkpoints/checkpoint_<n>``, oldest (lowest n) first."""
    root = os.path.join(accelerator.project_dir, "checkpoints")
    found = [(int(m.group(1)), n) for n in os.listdir(root) if (m := _NUMBERED.fullmatch(n))]
    return [os.path.join(root, n) for _, n in sorted(found)]


def _automatic_save_dir(accelerator: Accelerator) -> str:
    """Accelerate's ``save_state`` with ``automatic_checkpoint_naming``: make room under
    ``total_limit`` (rank 0), then the next ``checkpoint_<iteration>``, which must not exist."""
    config = accelerator.project_configuration
    os.makedirs(os.path.join(accelerator.project_dir, "checkpoints"), exist_ok=True)
    folders = _numbered_checkpoints(accelerator)
    if config.total_limit is not None and len(folders) + 1 > config.total_limit and accelerator.is_main_process:
        wait_all()  # a pending save may be writing one of them
        for folder in folders[: len(folders) + 1 - config.total_limit]:
            delete_checkpoint(folder)
    target = os.path.join(accelerator.project_dir, "checkpoints", f"checkpoint_{accelerator.save_iteration}")
    if os.path.exists(target):
        raise ValueError(
            f"Checkpoint directory {target} ({accelerator.save_iteration}) already exists. Please manually override "
            "`self.save_iteration` with what iteration to start with."
        )
    accelerator.wait_for_everyone()
    return target


def save_state(accelerator: Accelerator, dir: str | None = None, *, async_save: bool = False) -> SaveHandle:
    """``accelerator.save_state(dir)`` through unickpt, on every rank: ``dir`` becomes a unickpt
    checkpoint folder (with ``automatic_checkpoint_naming``: Accelerate's next numbered folder,
    module docstring). ``async_save=True`` returns once the snapshot is taken (the handle's
    ``wait()``, or ``unickpt.wait_all()``, waits for the commit)."""
    if accelerator.project_configuration.automatic_checkpoint_naming:
        dir = _automatic_save_dir(accelerator)
    elif dir is None:
        raise ValueError("save_state needs a folder unless automatic checkpoint naming is enabled")
    handle = save(str(dir), accelerate_state(accelerator), async_save=async_save)
    accelerator.project_configuration.iteration += 1  # as Accelerate's save_state
    return handle


def load_state(
    accelerator: Accelerator, dir: str | None = None, *, strict: bool = True, options: LoadOptions | None = None
) -> None:
    """``accelerator.load_state(dir)`` through unickpt, on every rank, after ``accelerator.prepare``:
    everything ``save_state`` saved is loaded in place, resharded to this job's world size
    (``options``: unickpt's ``LoadOptions``, e.g. ``loader_on_resize="skip"`` for a stateful
    dataloader after a change of world size; ``restore.resize_plain_tensors`` is always on: a
    parameter or buffer the checkpoint holds with another shape goes through the model's own
    ``load_state_dict``, as in Accelerate's own load). No ``dir`` with
    ``automatic_checkpoint_naming``: the newest ``checkpoint_<n>``."""
    if dir is None:
        if not accelerator.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        folders = _numbered_checkpoints(accelerator)
        if not folders:
            raise NotACheckpointError(f"no checkpoint_<n> under {accelerator.project_dir}/checkpoints")
        dir = folders[-1]
    options = options or LoadOptions()
    # a parameter or buffer saved with another shape (a buffer the model grows as it trains) goes
    # through the model's own load_state_dict, as Accelerate's own load hands it every tensor
    options = replace(options, restore=replace(options.restore, resize_plain_tensors=True))
    load(str(dir), accelerate_state(accelerator), strict=strict, options=options)
