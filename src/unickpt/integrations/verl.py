"""unickpt as verl's FSDP checkpoint manager: ``UnickptFSDPCheckpointManager`` and ``install()``.

verl's FSDP engine (``verl.workers.engine.fsdp.transformer_impl.FSDPEngine.initialize``, and
veomni's engine) builds ``FSDPCheckpointManager(model=, optimizer=, lr_scheduler=,
processing_class=, checkpoint_config=, trust_remote_code=)`` by the name its module imported.
``install()`` rebinds that name in those modules (and in ``verl.workers.fsdp_workers`` of older
verl releases) to ``UnickptFSDPCheckpointManager``: call it in every worker process before the
engine is built (e.g. at the top of the trainer's entry point, or from a verl plugin via
``VERL_USE_EXTERNAL_MODULES``). ``uninstall()`` puts verl's class back. See
docs/integrations/verl.md.

The manager keeps verl's contract (``BaseCheckpointManager``), called on every rank by the
engine's ``save_checkpoint`` / ``load_checkpoint``:

* ``save_checkpoint(local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None)``: one
  unickpt checkpoint at ``local_path`` (``local_path/<role>`` with a ``role``) holding what
  ``checkpoint_config.save_contents`` names: ``model`` (the FSDP1/FSDP2 module: parameters by
  name, resharded at load, so it loads at any world size), ``optimizer`` (state by parameter
  name), ``extra`` (``lr_scheduler``: the scheduler's ``state_dict()``, replicated; ``rng``: each
  rank's generators as verl's ``get_rng_state`` takes them, ``unickpt.PerRank``). Then rank 0
  writes the model's Hugging Face config and tokenizer/processor into ``huggingface/`` (as verl
  does) and, with ``hf_model``, the full model as safetensors there (verl's
  ``get_fsdp_full_state_dict`` and ``save_pretrained``). Parameters and optimizer state are read
  where they are: with FSDP2's ``CPUOffloadPolicy`` (verl's ``offload_policy``) both on the CPU;
  with ``param_offload`` the engine moves the parameters to the GPU before calling the manager,
  and with ``optimizer_offload`` the optimizer state stays on the CPU (a load fills those CPU
  tensors in place).
  ``checkpoint.async_save: true``: the call returns once the snapshot is taken; the write and
  the commit run in the background; the next save or load (or ``wait()``, or ``close()``)
  waits for it first, then applies retention.
* Retention (``max_ckpt_to_keep``, rank 0, after the new save committed): the oldest paths this
  manager saved beyond the limit lose their unickpt checkpoint (``integrations._delete``: only
  unickpt's own files, metadata first) and the ``huggingface/`` files this manager wrote there;
  a file of anyone else (verl's ``data.pt``, the user's) stays, and so does its folder.
* ``load_checkpoint(local_path, hdfs_path=None, del_local_after_load=False)``: what
  ``load_contents`` names, in place, at any world size (strict over those keys).
  ``hdfs_path`` is unused and ``del_local_after_load`` applies to downloaded copies in verl;
  unickpt reads ``local_path`` where it is (any unickpt storage URL), so both are ignored.

Actor and critic: verl's trainer gives them different folders (``global_step_N/actor``,
``.../critic``); managers that share one folder take ``role="actor"`` / ``role="critic"``
(``UnickptFSDPCheckpointManager.with_role``). Each manager has its own ``unickpt.Checkpointer``,
so the actor's async save never waits for the critic's.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

from .. import Checkpointer, PerRank, SaveHandle
from ..errors import ConfigurationError
from ..storage import open_storage
from ._delete import delete_checkpoint

__all__ = ["UnickptFSDPCheckpointManager", "install", "uninstall", "INSTALL_TARGETS"]

# where verl's workers look up the manager class (module, attribute)
INSTALL_TARGETS = (
    ("verl.workers.engine.fsdp.transformer_impl", "FSDPCheckpointManager"),
    ("verl.workers.engine.veomni.transformer_impl", "FSDPCheckpointManager"),
    ("verl.workers.fsdp_workers", "FSDPCheckpointManager"),  # verl < 0.7
)
_ORIGINAL: dict[tuple[str, str], Any] = {}


class VerlRngState:
    """This rank's generators, taken and set by verl's own ``get_rng_state`` / ``load_rng_state``."""

    def state_dict(self) -> dict[str, Any]:
        return FSDPCheckpointManager.get_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        FSDPCheckpointManager.load_rng_state(state)


class UnickptFSDPCheckpointManager(FSDPCheckpointManager):
    """verl's FSDP checkpoint manager contract backed by unickpt (module docstring)."""

    def __init__(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        processing_class: Any = None,
        checkpoint_config: Any = None,
        trust_remote_code: bool = False,
        role: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            lr_scheduler=lr_scheduler,
            processing_class=processing_class,
            checkpoint_config=checkpoint_config,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )
        self.role = role
        self.async_save = bool(checkpoint_config.get("async_save", False)) if checkpoint_config else False
        self.checkpointer = Checkpointer()  # its own worker and staging: roles never wait on each other
        self._pending: tuple[SaveHandle, int | None, str] | None = None
        self._hf_files: dict[str, list[str]] = {}  # checkpoint path -> huggingface/ files written there

    @classmethod
    def with_role(cls, role: str) -> Any:
        """A constructor with verl's signature that builds managers saving under ``role``."""

        def build(*args: Any, **kwargs: Any) -> UnickptFSDPCheckpointManager:
            kwargs["role"] = role
            return cls(*args, **kwargs)

        return build

    # ------------------------------------------------------------------ what is saved

    def _state(self, contents: list[str] | tuple[str, ...]) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if "model" in contents:
            if self.model is None:
                raise ConfigurationError("checkpoint contents name 'model' but the manager has no model")
            state["model"] = self.model
        if "optimizer" in contents:
            if self.optimizer is None:
                raise ConfigurationError("checkpoint contents name 'optimizer' but the manager has no optimizer")
            state["optimizer"] = self.optimizer
        if "extra" in contents:
            if self.lr_scheduler is not None:
                state["lr_scheduler"] = self.lr_scheduler
            state["rng"] = PerRank(VerlRngState())
        return state

    def _target(self, local_path: str) -> str:
        return os.path.join(local_path, self.role) if self.role else local_path

    # ------------------------------------------------------------------ save

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> None:
        if local_path is None:
            return
        self.wait()
        self.previous_global_step = global_step  # type: ignore[assignment]
        path = self._target(local_path)
        state = self._state(self.checkpoint_save_contents)
        # an async save takes its folder when its write starts: the HF files follow its commit
        async_save = self.async_save and not self.should_save_hf_model and bool(state)
        handle = None
        if state:
            handle = self.checkpointer.save(local_path, state, role=self.role, async_save=async_save)
        if self.rank == 0:
            self.previous_saved_paths.append(path)
        if handle is not None and async_save:
            self._pending = (handle, max_ckpt_to_keep, path)
            return
        self._save_hf_config(path)
        if self.should_save_hf_model:
            self._save_hf_model(path)
        self._apply_retention(max_ckpt_to_keep)

    def wait(self) -> None:
        """Every rank: wait for this manager's pending async save to commit (raises its failure),
        then rank 0 writes its HF config files and applies retention. The next save and load
        call this first."""
        pending, self._pending = self._pending, None
        if pending is not None:
            handle, keep, path = pending
            handle.wait()
            self._save_hf_config(path)
            self._apply_retention(keep)

    def _apply_retention(self, max_ckpt_to_keep: int | None) -> None:
        """Rank 0: keep the ``max_ckpt_to_keep`` newest paths this manager saved (verl's rule:
        a positive int), deleting only unickpt's files and the HF files it wrote there."""
        if self.rank != 0 or not (isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep > 0):
            return
        drop = self.previous_saved_paths[:-max_ckpt_to_keep]
        self.previous_saved_paths = self.previous_saved_paths[-max_ckpt_to_keep:]
        for path in drop:
            if path in self.previous_saved_paths:
                continue  # saved again since: it is one of the newest
            delete_checkpoint(path)
            self._delete_hf_files(path)

    def _delete_hf_files(self, path: str) -> None:
        """The HF files this manager wrote under ``path/huggingface``, then the folders if empty;
        nothing when ``path`` or its ``huggingface`` folder is a link (never followed)."""
        folder = os.path.join(path, "huggingface")
        names = self._hf_files.pop(path, [])
        if "://" in path:  # a storage URL: the objects this manager put there
            open_storage(path).delete([f"huggingface/{name}" for name in names])
            return
        if os.path.islink(path) or os.path.islink(folder):
            return
        for name in names:
            file = os.path.join(folder, name)
            if os.path.isfile(file) and not os.path.islink(file):
                os.remove(file)
        for empty in (folder, path):
            try:
                os.rmdir(empty)  # only when nothing of anyone else's is left
            except OSError:
                pass

    @contextmanager
    def _records_hf_files(self, path: str) -> Iterator[str]:
        """Yields ``path/huggingface``; the files that appear there are recorded as this manager's.
        For a storage URL (``s3://``, ``gs://``, ``az://``...) it yields a local temporary folder
        whose files then go to ``path/huggingface/`` through unickpt's storage."""
        if "://" in path:
            with tempfile.TemporaryDirectory(prefix="unickpt-verl-hf-") as local:
                yield local
                new = sorted(n for n in os.listdir(local) if os.path.isfile(os.path.join(local, n)))
                storage = open_storage(path)
                for name in new:  # replaced, as save_pretrained replaces a local file
                    with open(os.path.join(local, name), "rb") as f:
                        data = f.read()
                    storage.delete([f"huggingface/{name}"])
                    storage.write(f"huggingface/{name}", [data])
                self._hf_files[path] = sorted(set(self._hf_files.get(path, [])) | set(new))
            return
        folder = os.path.join(path, "huggingface")
        os.makedirs(folder, exist_ok=True)
        before = set(os.listdir(folder))
        try:
            yield folder
        finally:
            new = sorted(set(os.listdir(folder)) - before)
            self._hf_files[path] = sorted(set(self._hf_files.get(path, [])) | set(new))

    def _unwrapped(self) -> Any:
        return getattr(self.model, "_fsdp_wrapped_module", self.model)

    def _save_hf_config(self, path: str) -> None:
        """Rank 0: the model's HF config and the tokenizer/processor into ``path/huggingface``
        (as verl, for its merger and for ``hf_model``), once the checkpoint holds the folder."""
        config = getattr(self._unwrapped(), "config", None)
        if self.rank == 0 and config is not None:
            with self._records_hf_files(path) as folder:
                config.save_pretrained(folder)
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(folder)

    def _save_hf_model(self, path: str) -> None:
        """verl's ``hf_model`` export (every rank: a collective): the full state dict gathered to
        rank 0 (on the CPU), an empty HF model of the config's architecture, ``save_pretrained``
        into ``huggingface/``."""
        from verl.utils.fsdp_utils import get_fsdp_full_state_dict

        unwrapped = self._unwrapped()
        config = getattr(unwrapped, "config", None)
        if config is None:
            raise ConfigurationError("save_contents names 'hf_model' but the model has no Hugging Face config")
        full = get_fsdp_full_state_dict(self.model, offload_to_cpu=True, rank0_only=True)
        if self.rank == 0:
            self._write_hf_model(path, unwrapped, config, full)
        if dist.is_initialized():
            dist.barrier()

    def _write_hf_model(self, path: str, unwrapped: Any, config: Any, full: dict[str, torch.Tensor]) -> None:
        import transformers
        from accelerate import init_empty_weights
        from verl.utils.transformers_compat import drop_tied_target_keys, get_auto_model_for_vision2seq

        arch = (getattr(config, "architectures", None) or [type(unwrapped).__name__])[0]
        auto_cls: Any
        if "ForTokenClassification" in arch:
            auto_cls = transformers.AutoModelForTokenClassification
        elif "ForCausalLM" in arch:
            auto_cls = transformers.AutoModelForCausalLM
        elif "ForConditionalGeneration" in arch:
            auto_cls = get_auto_model_for_vision2seq()
        else:
            raise ConfigurationError(f"hf_model: unknown architecture {arch!r}")
        with init_empty_weights():
            hf_model = auto_cls.from_config(
                config, torch_dtype=torch.bfloat16, trust_remote_code=self.trust_remote_code
            )
        hf_model.to_empty(device="cpu")
        drop_tied_target_keys(full, hf_model, config)
        with self._records_hf_files(path) as folder:
            hf_model.save_pretrained(folder, state_dict=full)

    # ------------------------------------------------------------------ load

    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False, **kwargs: Any
    ) -> None:
        if local_path is None:
            return
        self.wait()
        state = self._state(self.checkpoint_load_contents)
        if not state:
            return
        everything = self._state(["model", "optimizer", "extra"])
        partial = len(state) < len(everything)
        with warnings.catch_warnings():
            if partial:  # asked for a subset on purpose: the keys left out are not news
                warnings.filterwarnings("ignore", message="non-strict load")
            self.checkpointer.load(local_path, state, role=self.role, strict=not partial)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Wait for the pending save (and its retention), then free the checkpointer."""
        if not self.checkpointer.closed:
            try:
                self.wait()
            finally:
                self.checkpointer.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit unickpt's exit hook reports unwaited failures
            pass


def install() -> list[str]:
    """Make verl's FSDP workers build ``UnickptFSDPCheckpointManager``: rebinds
    ``FSDPCheckpointManager`` in each module of ``INSTALL_TARGETS`` that imports here; returns
    their names. Call in every process that builds a verl engine, before it is built."""
    import importlib

    done = []
    for module_name, attr in INSTALL_TARGETS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # an engine whose optional dependencies are absent, or an older layout
            continue
        if not hasattr(module, attr):
            continue
        current = getattr(module, attr)
        if current is not UnickptFSDPCheckpointManager:
            _ORIGINAL[(module_name, attr)] = current
            setattr(module, attr, UnickptFSDPCheckpointManager)
        done.append(module_name)
    if not done:
        raise ConfigurationError("unickpt.integrations.verl.install(): no verl FSDP worker module was found to patch")
    return done


def uninstall() -> None:
    """Put back the classes ``install()`` replaced."""
    import importlib

    for (module_name, attr), original in list(_ORIGINAL.items()):
        setattr(importlib.import_module(module_name), attr, original)
        del _ORIGINAL[(module_name, attr)]
