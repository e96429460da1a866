"""unickpt as torchtitan's checkpoint manager: ``UnickptCheckpointManager``.

torchtitan builds its checkpoint manager from ``Trainer.Config.checkpoint`` (a
``BaseCheckpointManager.Config``): ``config.checkpoint.build(...)`` constructs the class that
declares that ``Config`` (``Configurable``'s ``_owner``). So a job switches by giving
``checkpoint=UnickptCheckpointManager.Config(...)`` in place of ``CheckpointManager.Config(...)``
(same fields, plus ``dataloader_on_resize``); see docs/integrations/torchtitan.md. Where a job's
config is built elsewhere: ``unickpt_config(config.checkpoint, ...)`` converts it keeping every
field, and the torchtitan override ``use_unickpt`` does the same from the command line
(``--override.imports unickpt.integrations.torchtitan.use_unickpt``).

What it saves, through one ``unickpt.Checkpointer`` (``open state``, docs/state.md), in the
trainer's ``step-N`` folders under ``dump_folder/checkpoint.folder``:
  ``model``         the trainer's model parts (a list of modules, FSDP2/TP as they are), read
                    by name, so a checkpoint loads at any world size and number of parts;
  ``optimizer``     the ``OptimizersContainer``, whose own ``state`` is empty: unickpt reads its
                    inner ``optimizers`` (``frameworks.parts.unwrap_optimizer``, rule 1);
  ``lr_scheduler``  the ``LRSchedulersContainer`` (a replicated ``Stateful``);
  ``dataloader``    torchtitan's per-DP-rank ``state_dict`` (restored at the same world size;
                    after a change ``dataloader_on_resize`` decides: ``"error"`` or ``"skip"``);
  every entry of ``states`` (``train_state``: the trainer, step and tokens seen).

Order of use (torchtitan's ``Trainer``, every rank): ``build`` -> ``__init__``; ``load(step)``
once before training; per step ``save(step, last_step)`` (saves when ``_should_save``), and
``maybe_wait_for_staging()`` before the next optimizer step (returns once an async save's
snapshot is taken, never waits for the write); ``close()`` at the end (drains pending saves).
Retention (``keep_latest_k``) runs on rank 0 after a save committed: it deletes the oldest
complete unickpt checkpoints (``folder.cleanup.delete_checkpoint``: unickpt's own files only,
metadata first), never a folder unickpt did not write. As torchtitan's DCP manager
(``CheckpointManager._save`` returns right after ``_save_last_step``), a last-step save
(model-only, full or HF) is followed by no purge: the ``keep_latest_k`` checkpoints before it stay.
A model-only last save (``last_save_model_only``) holds the model's tensors under their usual
names, floating-point ones cast to ``export_dtype`` as torchtitan's ``_save_last_step`` casts
them; an ``initial_load_path`` load converts the saved dtypes to the model's (as DCP's load does).
``last_save_in_hf`` / ``initial_load_in_hf``: Hugging Face safetensors through torchtitan's
state-dict adapter (``_save_hf``, ``_load_hf``). Not supported: quantized HF checkpoints
(refused by ``Config``).

Fast recovery (``unickpt_fast_root="shm://<job>"``; docs/guide/recovery.md): the periodic saves
go through a ``TieredCheckpointManager(unickpt_fast_root, <checkpoint folder>,
replicas=unickpt_replicas, durable_every=unickpt_durable_every, keep_fast=unickpt_keep_fast,
keep_durable=keep_latest_k or None)``: each host's RAM, copied to ``unickpt_replicas`` other
hosts, and every ``unickpt_durable_every``-th step also to the checkpoint folder (its
``step_NNNNNNNN`` folders, the tier's layout; the tier's retention replaces
``_purge_stale_checkpoints``). ``load()`` (no step) is the tier's ``load_latest``: the newest
step complete across every host's RAM and the folder; ``load(step)`` reads that step from the
folder. The last step's model-only / HF saves stay ``step-N`` folders written as without the tier.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
)
from torchtitan.components.checkpointer.dcp import CheckpointManager
from torchtitan.config import TORCH_DTYPE_MAP, derive, override
from torchtitan.tools import filesystem

from .. import Checkpointer, SaveHandle, TieredCheckpointManager
from ..errors import CorruptMetadataError, MissingKeysError, SizeLimitError
from ..folder.cleanup import delete_checkpoint
from ..format.records import METADATA_FILE
from ..options import LoadOptions, RestoreOptions
from ..storage import Storage, open_storage

__all__ = ["UnickptCheckpointManager", "unickpt_config", "use_unickpt"]

_STEP_FOLDER = re.compile(r"step-(\d+)")
_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _torchtitan_hook(hook: Any) -> bool:
    """Whether a module hook is torchtitan's own (FSDP2's hooks, on the same modules, are not)."""
    fn = getattr(hook, "hook", hook)  # torch's _WrappedHook keeps the function in .hook
    return str(getattr(fn, "__module__", "")).startswith("torchtitan.")


@contextmanager
def parameters_as_held(parts: list[nn.Module]) -> Iterator[None]:
    """Suspend torchtitan's own state-dict hooks for one unickpt call, so that unickpt reads
    the parameters as the model holds them. torchtitan's ``FusedQKVLinear`` splits its fused
    ``wqkv`` into fresh ``wq``/``wk``/``wv`` tensors in ``state_dict()``: loading into those in
    place would change copies, and its optimizer state is keyed ``wqkv``. The checkpoint's names
    are therefore the parameters' (``...qkv_linear.wqkv.weight``); a model built unfused loads it
    with ``LoadOptions(restore=RestoreOptions(transforms=...))`` (``split_rows``). Other hooks (FSDP2's) stay."""
    saved = []
    for part in parts:
        for m in part.modules():
            for attr in _HOOKS:
                hooks = getattr(m, attr, None)
                if hooks and any(_torchtitan_hook(h) for h in hooks.values()):
                    saved.append((m, attr, hooks))
                    setattr(m, attr, OrderedDict((k, h) for k, h in hooks.items() if not _torchtitan_hook(h)))
    try:
        yield
    finally:
        for m, attr, hooks in saved:
            setattr(m, attr, hooks)


def cast_model_copy(part: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A module holding ``part``'s ``state_dict()`` tensors under the same names and kinds
    (parameter or buffer), floating-point ones cast to ``dtype`` (a new tensor; a DTensor stays a
    DTensor, each rank casting its own shard); the rest (integers, tensors already in ``dtype``)
    are the part's own tensors, not copied. What a model-only last save writes when
    ``export_dtype`` is not the model's. Called by ``UnickptCheckpointManager._save_model_only``
    under ``parameters_as_held``; the copy lives for that save."""
    params = {id(p) for p in part.parameters()}
    copy = nn.Module()
    with torch.no_grad():
        for name, t in part.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):
                continue  # a module's _extra_state: not a tensor of the model
            value = t.detach()
            if value.is_floating_point() and value.dtype != dtype:
                value = value.to(dtype)
            *path, leaf = name.split(".")
            owner = copy
            for attr in path:
                if attr not in owner._modules:
                    owner.add_module(attr, nn.Module())
                owner = owner._modules[attr]  # type: ignore[assignment]
            if id(t) in params:
                owner.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
            else:
                owner.register_buffer(leaf, value)
    return copy


class UnickptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, backed by unickpt (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``"async"`` / ``"async_with_pinned_mem"``: an async unickpt save (the step waits only for
        the snapshot, in ``maybe_wait_for_staging``); ``"disabled"``: blocking saves."""

        dataloader_on_resize: Literal["error", "skip"] = "error"
        """torchtitan's dataloader state is per DP rank: after a change of world size ``"error"``
        refuses the load (nothing changed), ``"skip"`` leaves the dataloader fresh, with a warning."""

        unickpt_fast_root: str = ""
        """``"shm://<job>"``: periodic saves go to each host's RAM first, replicated to other hosts
        (``unickpt.TieredCheckpointManager``, module docstring); ``""``: saves go to the folder only."""

        unickpt_replicas: int = 1
        """With ``unickpt_fast_root``: how many other hosts hold a copy of each host's RAM save."""

        unickpt_durable_every: int | None = None
        """With ``unickpt_fast_root``: the steps (multiples of it) also copied to the checkpoint
        folder; ``None``: every saved step."""

        unickpt_keep_fast: int = 2
        """With ``unickpt_fast_root``: the newest steps each host keeps in RAM."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"Invalid async_mode: {self.async_mode}")
            if self.dataloader_on_resize not in ("error", "skip"):
                raise ValueError(f"Invalid dataloader_on_resize: {self.dataloader_on_resize}")
            if self.initial_load_in_hf_quantized:
                raise ValueError("UnickptCheckpointManager does not read quantized Hugging Face checkpoints")
            if self.unickpt_fast_root and not self.unickpt_fast_root.startswith("shm://"):
                raise ValueError(f"unickpt_fast_root must be shm://<name>, got {self.unickpt_fast_root!r}")

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: SaveHandle | None = None  # type: ignore[assignment]
        self._staging: SaveHandle | None = None
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: list(model_parts), OPTIMIZER: optimizers, LR_SCHEDULER: lr_schedulers})
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.initial_load_in_hf = config.initial_load_in_hf
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.last_save_in_hf = config.last_save_in_hf
        if self.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided.")
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.keep_latest_k = config.keep_latest_k
        self.async_save = config.async_mode != "disabled"
        self.load_options = LoadOptions(restore=RestoreOptions(loader_on_resize=config.dataloader_on_resize))
        self.sd_adapter = sd_adapter
        self.checkpointer = Checkpointer()  # its own: events listeners, worker, staging memory
        self._storage: Storage | None = None
        self._tiers: TieredCheckpointManager | None = None
        if config.unickpt_fast_root:
            self._tiers = TieredCheckpointManager(
                config.unickpt_fast_root, self.folder, replicas=config.unickpt_replicas,
                durable_every=config.unickpt_durable_every, keep_fast=config.unickpt_keep_fast,
                keep_durable=self.keep_latest_k or None, checkpointer=self.checkpointer,
            )  # fmt: skip

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------------ folders

    def _create_checkpoint_id(self, step: int) -> str:
        return filesystem.join(self.folder, f"step-{step}")

    def _root(self) -> Storage:
        if self._storage is None:
            self._storage = open_storage(self.folder)
        return self._storage

    def _complete_steps(self) -> list[int]:
        """Steps whose ``step-N`` folder holds a committed unickpt checkpoint, ascending. A
        storage URL (``s3://``, ``gs://``, ``az://``...) is listed through unickpt's storage, not
        torchtitan's fsspec helpers (which need s3fs / gcsfs / adlfs)."""
        if filesystem.is_remote(self.folder):
            names = self._root().list("step-")
            found = (
                _STEP_FOLDER.fullmatch(n[: -len(METADATA_FILE) - 1]) for n in names if n.endswith(f"/{METADATA_FILE}")
            )
            return sorted(int(m.group(1)) for m in found if m)
        if not filesystem.isdir(self.folder):
            return []
        steps = []
        for name in filesystem.listdir(self.folder):
            m = _STEP_FOLDER.fullmatch(name)
            if m and self._root().size(f"{name}/{METADATA_FILE}") is not None:
                steps.append(int(m.group(1)))
        return sorted(steps)

    # ------------------------------------------------------------------ save

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()  # one save in flight at a time, as torchtitan's DCP manager
        path = self._create_checkpoint_id(curr_step)
        if last_step and self.last_save_in_hf:
            self._save_hf(path)
            return True
        if last_step and self.last_save_model_only:  # torchtitan's _save_last_step: cast, no purge
            self._save_model_only(path)
            return True
        async_save = self.async_save and not last_step
        with parameters_as_held(self.states[MODEL]):
            if self._tiers is not None:  # RAM, replicas, the folder every durable_every-th step
                handle = self._tiers.save(curr_step, dict(self.states), async_save=async_save)
            else:
                handle = self.checkpointer.save(path, dict(self.states), async_save=async_save)
        if async_save:
            self.save_future, self._staging = handle, handle  # type: ignore[assignment]
        elif not last_step and self._tiers is None:  # a full last-step save is not followed by a purge either
            self._purge_stale_checkpoints()
        return True

    def _save_model_only(self, path: str) -> None:
        """The last step's model, floating-point tensors in ``export_dtype`` (blocking).
        Parts already in that dtype are saved as they are (no copy)."""
        parts = self.states[MODEL]
        with parameters_as_held(parts):
            if any(
                t.is_floating_point() and t.dtype != self.export_dtype
                for part in parts
                for t in part.state_dict(keep_vars=True).values()
                if isinstance(t, torch.Tensor)
            ):
                parts = [cast_model_copy(part, self.export_dtype) for part in parts]
            self.checkpointer.save(path, {MODEL: parts})

    def _save_hf(self, path: str) -> None:
        """The last step as Hugging Face safetensors through torchtitan's state-dict adapter,
        written by every rank, each its own share (``engine.export.hf``; no rank gathers the
        model): the model's canonical ``state_dict()`` as sharded (DTensors), cast to
        ``export_dtype``, ``sd_adapter.to_hf`` (renames; a reshape of a DTensor is DTensor's
        own), then ``model.safetensors`` and its index in the new ``step-N`` folder (a folder
        that is not empty is refused, never overwritten). Collective."""
        from .. import HFExport
        from ..engine.export.hf import export_pieces, pieces_of_tensors

        sharded: dict[str, torch.Tensor] = {}
        for part in self.states[MODEL]:
            for key, value in part.state_dict().items():
                v = value.detach()
                sharded[key] = v.to(self.export_dtype) if v.is_floating_point() else v
        hf = self.sd_adapter.to_hf(sharded)
        coord = self.checkpointer.resources.coordinator("foreground", None, f"Hugging Face export into {path}")
        export_pieces(path, pieces_of_tensors(hf), HFExport(max_shard_bytes=1 << 62), coord)

    def _maybe_wait_for_staging(self) -> None:
        if self._staging is not None:
            self._staging.wait_snapshot()
            self._staging = None

    def _wait_for_saving(self) -> None:
        handle, self.save_future = self.save_future, None
        self._staging = None
        assert handle is not None
        handle.wait()
        if self._tiers is None:  # the tier applies its own retention
            self._purge_stale_checkpoints()

    def _purge_stale_checkpoints(self) -> None:
        """Rank 0: keep the ``keep_latest_k`` newest complete unickpt checkpoints."""
        if self.keep_latest_k <= 0 or self.checkpointer.rank() != 0:
            return
        root = self._root()
        for step in self._complete_steps()[: -self.keep_latest_k]:  # unickpt's files only, metadata first
            delete_checkpoint(root, f"step-{step}/", locks=self.checkpointer.resources.locks)

    # ------------------------------------------------------------------ load

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        has_folder = filesystem.is_remote(self.folder) or filesystem.isdir(self.folder)  # no folders on a URL
        if step != -1 and not has_folder:
            raise FileNotFoundError(
                f"--checkpoint.load_step={step} not found because checkpoint.folder {self.folder} does not exist"
            )
        if self._tiers is not None:
            return self._load_tiered(step)
        complete = self._complete_steps()
        options = self.load_options
        load_step = (complete[-1] if complete else -1) if step == -1 else step
        if load_step == -1:
            hf_path = self.initial_load_path or (self.sd_adapter and self.sd_adapter.hf_assets_path)
            if self.initial_load_in_hf and hf_path:
                self._load_hf(hf_path)
                return True
            if not self.initial_load_path:
                return False
            if not filesystem.isdir(self.initial_load_path):
                raise ValueError(f"Checkpoint.initial_load_path is invalid: {self.initial_load_path}")
            path, model_only = self.initial_load_path, self.initial_load_model_only
            # e.g. a model-only last save in export_dtype: converted to the model's dtypes, as DCP's load does
            options = dataclasses.replace(options, restore=dataclasses.replace(options.restore, cast_dtypes=True))
        else:
            if load_step not in complete:
                raise FileNotFoundError(f"--checkpoint.load_step={load_step} not found at {self.folder}")
            path, model_only = self._create_checkpoint_id(load_step), load_step == 0
        self._load_into(path, model_only, options)
        return True

    def _state_to_load(self, model_only: bool) -> dict[str, Any]:
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        if model_only:
            return {MODEL: self.states[MODEL]}
        return {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}

    def _load_into(self, path: str, model_only: bool, options: LoadOptions) -> None:
        state = self._state_to_load(model_only)
        partial = len(state) < len(self.states)
        with warnings.catch_warnings():
            if partial:  # asked for a subset on purpose: the keys left out are not news
                warnings.filterwarnings("ignore", message="non-strict load")
            with parameters_as_held(self.states[MODEL]):
                self.checkpointer.load(path, state, strict=not partial, options=options)

    def _load_tiered(self, step: int) -> bool:
        """``_load`` with ``unickpt_fast_root``: no step -> the tier's ``load_latest`` (every host's
        RAM and the folder's ``step_NNNNNNNN``; nothing there: ``_load`` as without the tier, i.e.
        ``step-N`` folders of a job that ran without it, then ``initial_load_path``); a step ->
        that step from the folder's ``step_NNNNNNNN``."""
        assert self._tiers is not None
        if step != -1:
            durable = self._tiers.durable
            if step not in [c.step for c in durable.list_checkpoints()]:
                raise FileNotFoundError(f"--checkpoint.load_step={step} not found at {self.folder}")
            self._load_into(durable.path_for(step), False, self.load_options)
            return True
        state = self._state_to_load(False)
        partial = len(state) < len(self.states)
        with warnings.catch_warnings():
            if partial:
                warnings.filterwarnings("ignore", message="non-strict load")
            with parameters_as_held(self.states[MODEL]):
                loaded = self._tiers.load_latest(state, strict=not partial, options=self.load_options)
        if loaded is not None:
            return True
        tiers, self._tiers = self._tiers, None
        try:  # nothing in the tier: as without it (``step-N`` folders, then ``initial_load_path``)
            return self._load(-1)
        finally:
            self._tiers = tiers

    def _load_hf(self, path: str) -> None:
        """The model from a Hugging Face safetensors folder through torchtitan's state-dict
        adapter (``initial_load_in_hf``): every rank reads the files its index names, then
        ``sd_adapter.from_hf``, the load pre-hooks of torchtitan's modules on those full tensors
        (they fuse ``wq``/``wk``/``wv`` into ``wqkv``), then ``set_model_state_dict`` on the
        parameters as held (each rank keeps its shards). Every parameter must be there."""
        import json
        import os

        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self.sd_adapter is None:
            raise ValueError("checkpoint.initial_load_in_hf is True, but sd_adapter is not provided.")
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            if os.path.getsize(index_path) > 64 << 20:
                raise SizeLimitError(f"{index_path} is larger than 64 MiB")
            with open(index_path) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        hf: dict[str, torch.Tensor] = {}
        for name in files:
            if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(".safetensors"):
                raise CorruptMetadataError(f"{index_path} names a file outside its folder: {name!r}")
            hf.update(load_file(os.path.join(path, name)))
        full = self.sd_adapter.from_hf(hf)
        parts = self.states[MODEL]
        for part in parts:  # canonical names -> the parameters as held (e.g. wq, wk, wv -> wqkv)
            for mname, m in part.named_modules():
                for hook in [h for h in m._load_state_dict_pre_hooks.values() if _torchtitan_hook(h)]:
                    hook(full, f"{mname}." if mname else "", {}, True, [], [], [])
        with parameters_as_held(parts):
            for part in parts:
                missing = sorted(set(part.state_dict()) - set(full))
                if missing:
                    raise MissingKeysError(f"{path} lacks {len(missing)} tensor(s) of the model: {missing[:10]}")
                set_model_state_dict(part, full, options=StateDictOptions(full_state_dict=True, strict=False))

    # ------------------------------------------------------------------ lifetime

    def _close(self) -> None:
        ckpt = getattr(self, "checkpointer", None)
        if ckpt is not None and not ckpt.closed:
            try:
                if self.save_future is not None:
                    self._wait_for_saving()  # commits the last async save, then retention
            finally:
                self.save_future = None
                self._staging = None
                tiers, self._tiers = getattr(self, "_tiers", None), None
                try:
                    if tiers is not None:
                        tiers.close()  # waits for the replication and durable copies
                finally:
                    ckpt.close()


def unickpt_config(config: BaseCheckpointManager.Config, **changes: Any) -> UnickptCheckpointManager.Config:
    """``config`` (torchtitan's DCP ``CheckpointManager.Config``, or any manager's) as
    ``UnickptCheckpointManager.Config``: every field both declare keeps its value (torchtitan's
    ``derive``: a debug model's ``last_save_model_only=False`` stays False), then ``changes``:
    ``config.checkpoint = unickpt_config(config.checkpoint, enable=True, interval=10)``."""
    return derive(config, UnickptCheckpointManager.Config, **changes)


@override(
    target=CheckpointManager.Config,
    description="unickpt checkpoint manager (unickpt.integrations.torchtitan), every checkpoint field kept",
)
def use_unickpt(config: CheckpointManager.Config, **changes: Any) -> UnickptCheckpointManager.Config:
    """torchtitan's override that selects the manager from the command line, the job's checkpoint
    fields kept (``unickpt_config``): ``--override.imports unickpt.integrations.torchtitan.use_unickpt``
    (``'unickpt.integrations.torchtitan.use_unickpt={"dataloader_on_resize": "skip"}'`` for the
    fields only unickpt's ``Config`` has). torchtitan's ``Trainer`` applies it before it builds
    anything; ``--checkpoint.<field>`` flags are parsed into the job's config first and kept."""
    return unickpt_config(config, **changes)
