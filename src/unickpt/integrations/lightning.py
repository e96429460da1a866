"""PyTorch Lightning strategies that checkpoint through unickpt: every rank saves its own shards,
and a checkpoint saved by N processes resumes on any number of processes.

``UnickptDDPStrategy``, ``UnickptFSDPStrategy`` (FSDP1) and ``UnickptModelParallelStrategy`` (FSDP2)
are Lightning's ``DDPStrategy`` / ``FSDPStrategy`` / ``ModelParallelStrategy`` with the same
constructor arguments plus ``async_save=False``. Lightning's ``CheckpointIO`` writes one dict from
rank 0, so the strategy's checkpoint hooks are the place, and Lightning calls them in this order:

* ``Trainer.save_checkpoint`` (``ModelCheckpoint`` included) builds Lightning's dict on every
  rank (``lightning_module_state_dict`` / ``optimizer_state`` return nothing here: the live
  module and optimizers are saved instead), then calls ``save_checkpoint`` on every rank: rank 0
  encodes the rest of the dict (loops, callbacks, LR schedulers, hyper-parameters, epoch,
  global step, precision plugin, datamodule, whatever ``on_save_checkpoint`` added) with
  unickpt's safe value encoding and broadcasts it, and every rank calls ``Checkpointer.save``
  with ``{"model": lightning_module, "optimizer": [optimizers], "lightning": that dict}``
  (a replicated ``Stateful``, saved once). The path is a unickpt checkpoint folder.
* ``fit(ckpt_path=...)``: these strategies restore after ``strategy.setup``
  (``restore_checkpoint_after_setup``), when the optimizers exist, so ``load_checkpoint`` loads
  the model and the optimizers in place (resharded to this job's world size and layout) and
  returns Lightning's dict, from which Lightning restores loops, callbacks and schedulers;
  ``load_model_state_dict`` / ``load_optimizer_state_dict`` then have nothing left to do.
* ``remove_checkpoint`` (``ModelCheckpoint``'s top-k): waits for this rank's pending saves, then
  rank 0 deletes the unickpt checkpoint at that path (only unickpt's files, ``_delete``); a
  symbolic link there (``save_last="link"``: Lightning's link to the newest checkpoint) is removed
  itself, never followed.
* Every load first waits for this process's pending asynchronous saves (a checkpoint saved with
  ``async_save=True`` just before, e.g. ``trainer.save_checkpoint`` then ``trainer.test(ckpt_path=...)``,
  is complete), and a path that does not exist raises ``NotACheckpointError`` (a
  ``FileNotFoundError``) with the message of Lightning's own ``CheckpointIO``.
* ``teardown``: waits for pending saves and closes the checkpointer.

* A path that is a file (a Lightning ``.ckpt`` or ``torch.save`` file of the time before
  unickpt) raises ``NotACheckpointError`` naming ``unickpt convert --from lightning``, which
  imports it once (model, optimizers, loops, callbacks, schedulers) into a checkpoint these
  strategies resume from at any world size.

Fast recovery (docs/guide/recovery.md): the Trainer's strategies take ``fast_root="shm://<job>"``,
``replicas=1``, ``durable_every=None``, ``keep_fast=2`` and ``durable_root=None`` (default: the
folder ``unickpt-tier`` beside the checkpoint paths). With ``fast_root`` set, ``save_checkpoint``
saves the state to a ``TieredCheckpointManager`` (each host's RAM, copied to ``replicas`` other
hosts, every ``durable_every``-th step also to ``durable_root``) as step ``global_step`` (once per
step: ``last.ckpt`` saved at the same step adds no second save), and rank 0 writes at the path
only a step marker (``integrations._tier``); ``fit(ckpt_path=<such a path>)`` (``"last"``
included) loads that step through the tier's ``load_latest`` (own RAM, peers' RAM, durable
folder), refusing with ``IncompleteCheckpointError`` a step that is not the tier's newest
recoverable one; ``remove_checkpoint`` deletes the marker only (the tier keeps its own
retention); ``teardown`` waits for the tier's copies.

Inference: ``load_from_checkpoint(LitModel, path, **kwargs)`` builds the module from the
hyper-parameters the checkpoint holds (``save_hyperparameters``), ``kwargs`` overriding them, as
Lightning's ``LitModel.load_from_checkpoint`` does for its own files, and loads the weights
through unickpt (any saved world size and parallelism). Lightning's own ``load_from_checkpoint``
reads one file with ``torch.load`` (a unickpt folder raises ``IsADirectoryError`` there, and
Lightning offers no hook before it): a module that also inherits ``UnickptLoadFromCheckpoint``
(first) sends a folder to ``load_from_checkpoint`` and any other path to Lightning's.

Fabric: ``UnickptFabricDDPStrategy`` / ``UnickptFabricFSDPStrategy`` / ``UnickptFabricModelParallelStrategy``
are Fabric's strategies of those names; ``fabric.save(path, state)`` hands the live objects of ``state``
(modules, optimizers, any ``Stateful``, plain values: unickpt's open state) to
``Checkpointer.save`` on every rank, and ``fabric.load(path, state)`` loads them in place
(``strict`` per key) and returns an empty remainder: unickpt restores into live objects only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.strategies import ParallelStrategy as FabricParallelStrategy
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, ParallelStrategy
from typing_extensions import override

from .. import Checkpointer, wait_all
from ..errors import ConfigurationError, NotACheckpointError, UnsupportedValueError
from ..format.values import dumps_value, loads_value
from ._delete import delete_checkpoint
from ._tier import TierKnobs, load_step, read_step_marker, write_step_marker

__all__ = [
    "UnickptDDPStrategy",
    "UnickptFSDPStrategy",
    "UnickptModelParallelStrategy",
    "UnickptFabricDDPStrategy",
    "UnickptFabricFSDPStrategy",
    "UnickptFabricModelParallelStrategy",
    "LIGHTNING_KEY",
    "load_from_checkpoint",
    "read_lightning_dict",
    "UnickptLoadFromCheckpoint",
]

LIGHTNING_KEY = "lightning"  # the state key of Lightning's own dict
_TENSOR_KEYS = ("state_dict", "optimizer_states")  # saved from the live objects instead


class _LightningDict:
    """Lightning's checkpoint dict (less model and optimizer states) as a replicated ``Stateful``:
    the bytes of its safe encoding, the same on every rank (rank 0's, broadcast)."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    def state_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.data}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        data = state.get("checkpoint")
        if not isinstance(data, bytes):
            raise UnsupportedValueError(f"state[{LIGHTNING_KEY!r}] holds no Lightning checkpoint dict")
        self.data = data


if TYPE_CHECKING:  # what the mixins are mixed into
    _Base = ParallelStrategy
    _FabricBase = FabricParallelStrategy
else:
    _Base = object
    _FabricBase = object


class _OwnsCheckpointer:
    """``async_save`` and the strategy's own ``unickpt.Checkpointer``, made at the first save or
    load on the world (again after a teardown closed it); mixed into the Trainer's and Fabric's
    strategies. Fabric has no teardown hook at the end: call ``checkpointer.wait()`` before the job
    exits when ``async_save=True``."""

    def __init__(self, *args: Any, async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.async_save = async_save
        self._unickpt: Checkpointer | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        if self._unickpt is None or self._unickpt.closed:
            self._unickpt = Checkpointer()
        return self._unickpt

    def _unickpt_load_path(self, path: Any) -> str:
        """The path to load (rank 0's), once this process's pending saves are done; a local path that
        does not exist raises what Lightning's ``CheckpointIO`` raises (a ``FileNotFoundError``)."""
        target = str(self.broadcast(str(path)))  # type: ignore[attr-defined]  # the strategy's
        wait_all()  # a save of this very path may still be in flight (any strategy of this process)
        if "://" not in target and not os.path.lexists(target):
            raise NotACheckpointError(f"Checkpoint file not found: {target}")
        if "://" not in target and os.path.isfile(target):
            raise NotACheckpointError(_file_hint(target))
        return target


def _file_hint(path: str) -> str:
    return (
        f"{path} is a file, not a unickpt checkpoint (a folder): a Lightning .ckpt (or torch.save) file from "
        f"before the switch to unickpt converts once with `unickpt convert --from lightning {path} OUT` "
        "(--from torch for a plain torch.save file); then resume with ckpt_path=OUT"
    )


class _UnickptCheckpointing(_OwnsCheckpointer, _Base):
    """The checkpoint hooks shared by the strategies (see the module docstring)."""

    def __init__(
        self,
        *args: Any,
        fast_root: str = "",
        replicas: int = 1,
        durable_every: int | None = None,
        keep_fast: int = 2,
        durable_root: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.tier_knobs = TierKnobs(fast_root, durable_root, replicas, durable_every, keep_fast)
        self._unickpt_tier: Any = None  # the TieredCheckpointManager, made at the first save or load
        self._unickpt_tier_saved: int | None = None  # the step this strategy saved to it last
        self.last_recovery: Any = None  # the tier's RecoveryReport of the last load

    def _unickpt_tiers(self, path: str) -> Any:
        """The tier (every rank, together: its construction is collective), its durable folder
        by default beside ``path``; None when ``fast_root`` is not set."""
        if not self.tier_knobs.on:
            return None
        if self._unickpt_tier is None:
            beside = os.path.dirname(os.path.abspath(path)) if "://" not in path else path.rsplit("/", 1)[0]
            self._unickpt_tier = self.tier_knobs.build(os.path.join(beside, "unickpt-tier"))
        return self._unickpt_tier

    # ---------------------------------------------------------------- what Lightning asks

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizers exist: one load restores the model and them

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # restored by load_checkpoint

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the live module is saved, by every rank, in save_checkpoint

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass

    # ---------------------------------------------------------------- save / load / remove

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported")
        path = str(self.broadcast(str(filepath)))
        rest = {k: v for k, v in checkpoint.items() if k not in _TENSOR_KEYS}
        state: dict[str, Any] = {
            "model": self._unickpt_module(),
            LIGHTNING_KEY: _LightningDict(self._unickpt_rank0_encoding(rest)),
        }
        if "optimizer_states" in checkpoint and self.optimizers:
            state["optimizer"] = self._unickpt_optimizers()
        tiers = self._unickpt_tiers(path)
        if tiers is None:
            self.checkpointer.save(path, state, async_save=self.async_save)
            return
        step = int(checkpoint.get("global_step", 0))
        if step != self._unickpt_tier_saved:  # last.ckpt at the same step: the marker only
            tiers.save(step, state, async_save=self.async_save)
            self._unickpt_tier_saved = step
        if self.is_global_zero:
            write_step_marker(path, step)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        target = str(self.broadcast(str(checkpoint_path)))
        step = self.broadcast(read_step_marker(target) if self.is_global_zero else None)
        holder = _LightningDict()
        module = self._unickpt_module()
        state: dict[str, Any] = {"model": module, LIGHTNING_KEY: holder}
        if self.optimizers:
            state["optimizer"] = self._unickpt_optimizers()
        strict = self._unickpt_lightning_module().strict_loading
        if step is not None:  # a step marker: the step is in the RAM tier
            path = target
            tiers = self._unickpt_tiers(path)
            if tiers is None:
                raise ConfigurationError(
                    f"{path} names step {step} of a RAM tier: construct the strategy with fast_root (and the "
                    "tier's other options) as when it was saved to resume from it"
                )
            load_step(tiers, int(step), path, state, strict=strict)
            self.last_recovery = tiers.last_recovery
        else:
            path = self._unickpt_load_path(checkpoint_path)
            self.checkpointer.load(path, state, strict=strict)
        checkpoint = loads_value(holder.data, f"{path}: the Lightning checkpoint dict")
        if not isinstance(checkpoint, dict):
            raise UnsupportedValueError(f"{path}: the Lightning checkpoint dict is a {type(checkpoint).__name__}")
        checkpoint["state_dict"] = self._unickpt_loaded_state_dict()  # for on_load_checkpoint hooks
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self._unickpt is not None:
            self._unickpt.wait()  # a pending save may be the one being removed
        if self.is_global_zero:
            url = "://" in str(filepath)  # kept whole: Path("gs://b/x") is "gs:/b/x"
            path = str(filepath) if url else str(Path(filepath))
            if not url and os.path.islink(path):  # save_last="link": Lightning's link, removed itself, never followed
                os.unlink(path)
            elif not url and read_step_marker(path) is not None:  # the tier's marker: the step stays in the tier
                os.unlink(path)
            else:
                delete_checkpoint(path)

    @override
    def teardown(self) -> None:
        ckpt, self._unickpt = self._unickpt, None
        tiers, self._unickpt_tier, self._unickpt_tier_saved = self._unickpt_tier, None, None
        try:
            if tiers is not None:
                tiers.close()  # the replications and durable copies done (or raised); RAM stays
            if ckpt is not None:
                ckpt.close()  # drains pending saves; raises a failed one
        finally:
            super().teardown()

    # ---------------------------------------------------------------- helpers

    def _unickpt_lightning_module(self) -> Any:
        module = self.lightning_module
        if module is None:
            raise RuntimeError(f"{type(self).__name__}: no LightningModule attached")
        return module

    def _unickpt_module(self) -> Any:
        """What unickpt saves as ``"model"``: the LightningModule (DDP, FSDP2: names as it reports them)."""
        return self._unickpt_lightning_module()

    def _unickpt_loaded_state_dict(self) -> dict[str, Any]:
        return dict(self._unickpt_lightning_module().state_dict())  # no collective for DDP / FSDP2

    def _unickpt_optimizers(self) -> list[Any]:
        opts = self.optimizers
        return [o._optimizer if isinstance(o, LightningOptimizer) else o for o in opts]

    def _unickpt_rank0_encoding(self, rest: dict[str, Any]) -> bytes:
        """Rank 0's dict in the safe value encoding, on every rank; an unsupported value is raised
        on every rank with rank 0's message."""
        outcome: tuple[str, Any] = ("ok", b"")
        if self.is_global_zero:
            try:
                outcome = ("ok", dumps_value(rest, "the Lightning checkpoint dict"))
            except (TypeError, ValueError, OverflowError, RecursionError) as e:
                outcome = ("error", f"{e}")
        kind, value = self.broadcast(outcome)
        if kind != "ok":
            raise UnsupportedValueError(f"cannot save the Lightning checkpoint dict with unickpt: {value}")
        return value


class UnickptDDPStrategy(_UnickptCheckpointing, DDPStrategy):
    """Lightning's ``DDPStrategy`` whose checkpoints are unickpt checkpoints (module docstring);
    ``async_save=True``: ``save_checkpoint`` returns once the snapshot is taken."""


class UnickptFSDPStrategy(_UnickptCheckpointing, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1, ``FullyShardedDataParallel``) whose checkpoints are unickpt
    checkpoints (module docstring): every rank saves the flat-parameter shards of the wrapped
    module (``strategy.model``) and its optimizers' shards, which load into FSDP1 at any world
    size (and into DDP / FSDP2 / plain modules: unickpt's FSDP1 adapter names them as the
    ``LightningModule`` does); Lightning's full-state gather is never run. ``state_dict_type`` has
    no effect on what is saved.

    CPU: Lightning's accelerator connectors refuse only ``type(strategy) is FSDPStrategy`` without a
    GPU accelerator, so this subclass passes them; Lightning's own wrapping passes ``device_id=None``
    on CPU, which torch's FSDP1 refuses, so on CPU wrap the submodules yourself in ``configure_model``
    with ``device_id=torch.device("cpu")`` (docs/integrations/lightning.md)."""

    @override
    def _unickpt_module(self) -> Any:
        """The ``FullyShardedDataParallel`` root that wraps the ``LightningModule`` (or the
        ``LightningModule`` itself when ``configure_model`` wrapped its submodules)."""
        return self.model if self.model is not None else self._unickpt_lightning_module()

    @override
    def _unickpt_loaded_state_dict(self) -> dict[str, Any]:
        """The loaded module's sharded state dict (``ShardedTensor`` values, like FSDP2's ``DTensor``
        ones: no rank gathers the whole model; a collective, and every rank calls ``load_checkpoint``)."""
        from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

        module = self._unickpt_module()
        with FullyShardedDataParallel.state_dict_type(module, StateDictType.SHARDED_STATE_DICT):
            return dict(module.state_dict())


class UnickptModelParallelStrategy(_UnickptCheckpointing, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel) whose checkpoints are unickpt
    checkpoints (module docstring); ``save_distributed_checkpoint`` has no effect: every rank
    always saves its own shards."""


class _UnickptFabricCheckpointing(_OwnsCheckpointer, _FabricBase):
    """Fabric's ``save_checkpoint`` / ``load_checkpoint`` through unickpt (module docstring)."""

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        if storage_options is not None or filter:
            raise TypeError(f"{type(self).__name__}.save_checkpoint: storage_options and filter are not supported")
        target = str(self.broadcast(str(path)))
        self.checkpointer.save(target, dict(state), async_save=self.async_save)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:
            raise TypeError(
                f"{type(self).__name__}.load_checkpoint needs the dict of live objects to load into "
                "(fabric.load(path, state)); unickpt does not return a checkpoint's contents"
            )
        self.checkpointer.load(self._unickpt_load_path(path), state, strict=strict)
        return {}

    @override
    def teardown(self) -> None:
        ckpt, self._unickpt = self._unickpt, None
        try:
            if ckpt is not None:
                ckpt.close()  # drains pending saves; raises a failed one
        finally:
            super().teardown()


class UnickptFabricDDPStrategy(_UnickptFabricCheckpointing, FabricDDPStrategy):
    """Fabric's ``DDPStrategy`` whose ``fabric.save`` / ``fabric.load`` go through unickpt."""


class UnickptFabricFSDPStrategy(_UnickptFabricCheckpointing, FabricFSDPStrategy):
    """Fabric's ``FSDPStrategy`` (FSDP1) whose ``fabric.save`` / ``fabric.load`` go through unickpt:
    the ``FullyShardedDataParallel`` modules and their optimizers, every rank its shards."""


class UnickptFabricModelParallelStrategy(_UnickptFabricCheckpointing, FabricModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` (FSDP2) whose ``fabric.save`` / ``fabric.load`` go through unickpt."""


# ---------------------------------------------------------------- inference: load_from_checkpoint


def read_lightning_dict(path: str, *, checkpointer: Checkpointer | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dict (less weights and optimizer states: ``epoch``, ``global_step``,
    ``hyper_parameters``, ``loops``, ``callbacks`` ...) of the unickpt checkpoint at ``path``, as
    these strategies (or ``unickpt convert --from lightning``) saved it. Reads no tensor; a unickpt
    load, so every rank of a job with a process group calls it."""
    import warnings

    holder = _LightningDict()
    with warnings.catch_warnings():  # the weights, not asked for here; a missing dict is raised below
        warnings.filterwarnings("ignore", message="non-strict load")
        (checkpointer or Checkpointer()).load(str(path), {LIGHTNING_KEY: holder}, strict=False)
    if not holder.data:
        raise NotACheckpointError(
            f"{path} holds no Lightning trainer state (state[{LIGHTNING_KEY!r}]): it was not saved by a unickpt "
            "Lightning strategy; load it with unickpt.load(path, {'model': module})"
        )
    checkpoint = loads_value(holder.data, f"{path}: the Lightning checkpoint dict")
    if not isinstance(checkpoint, dict):
        raise UnsupportedValueError(f"{path}: the Lightning checkpoint dict is a {type(checkpoint).__name__}")
    return checkpoint


def load_from_checkpoint(
    cls: type[Any], checkpoint_path: Any, *, map_location: Any = None, strict: bool | None = None, **kwargs: Any
) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` for a unickpt checkpoint (a folder
    saved by these strategies at any world size and parallelism, or made by ``unickpt convert
    --from lightning``): the module built from the saved ``hyper_parameters`` updated by
    ``kwargs`` (as Lightning builds it: ``hparams_name``, only ``__init__``'s arguments unless it
    takes ``**kwargs``; a checkpoint's ``_instantiator`` is refused: no code named by a checkpoint
    runs), ``configure_model()`` if overridden, the weights loaded through unickpt (``strict``:
    the module's ``strict_loading`` by default), then ``on_load_checkpoint(checkpoint)`` with
    ``checkpoint["state_dict"]`` the loaded module's (as the strategies call it: after the load),
    and the module moved to ``map_location`` (a device or its name; None: left on the CPU).
    Every rank calls it in a job with a process group (a unickpt load is collective)."""
    import inspect

    from lightning.pytorch import LightningModule

    if not (isinstance(cls, type) and issubclass(cls, LightningModule)):
        raise TypeError(f"load_from_checkpoint builds a LightningModule subclass, got {cls!r}")
    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise TypeError("load_from_checkpoint(map_location=...) takes a device or its name (e.g. 'cpu', 'cuda:0')")
    path = str(checkpoint_path)
    ckpt = Checkpointer()
    try:
        checkpoint = read_lightning_dict(path, checkpointer=ckpt)
        hparams = dict(checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY) or {})
        hparams.update(kwargs)
        if "_instantiator" in hparams:
            raise UnsupportedValueError(
                f"{path}: the hyper-parameters name an instantiator ({hparams['_instantiator']!r}); "
                "load_from_checkpoint runs no code a checkpoint names: build the module yourself and "
                "unickpt.load(path, {'model': module, 'lightning': None}, strict=False)"
            )
        signature = inspect.signature(cls.__init__)
        params = [p for p in list(signature.parameters.values())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        names = {p.name for p in params}
        args_name = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_NAME)
        if args_name and args_name in names:  # save_hyperparameters() of one Namespace / dict argument
            init_kwargs = {args_name: hparams}
        elif any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            init_kwargs = hparams
        else:
            init_kwargs = {k: v for k, v in hparams.items() if k in names}
        module = cls(**init_kwargs)
        if strict is None:
            strict = module.strict_loading
        if type(module).configure_model is not LightningModule.configure_model:
            module.configure_model()
        ckpt.load(path, {"model": module, LIGHTNING_KEY: _LightningDict()}, strict=strict)
    finally:
        ckpt.close()
    checkpoint["state_dict"] = dict(module.state_dict())
    module.on_load_checkpoint(checkpoint)
    return module.to(map_location) if map_location is not None else module


class UnickptLoadFromCheckpoint:
    """Mixed into a ``LightningModule`` (``class LitModel(UnickptLoadFromCheckpoint, L.LightningModule)``):
    ``LitModel.load_from_checkpoint(path, ...)`` loads a local folder (a unickpt checkpoint) with
    :func:`load_from_checkpoint` and any other path with Lightning's own ``load_from_checkpoint``."""

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: Any,
        map_location: Any = None,
        hparams_file: Any = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        path = checkpoint_path
        if isinstance(path, (str, os.PathLike)) and "://" not in str(path) and os.path.isdir(path):
            if hparams_file is not None:
                raise TypeError("load_from_checkpoint(hparams_file=...) is not supported for a unickpt checkpoint")
            kwargs.pop("weights_only", None)  # nothing is unpickled
            return load_from_checkpoint(cls, path, map_location=map_location, strict=strict, **kwargs)
        parent = super()
        return parent.load_from_checkpoint(  # type: ignore[misc,attr-defined]
            checkpoint_path, map_location=map_location, hparams_file=hparams_file, strict=strict, **kwargs
        )
