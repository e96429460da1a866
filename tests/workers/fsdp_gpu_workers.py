"""What tests/integration/integrations/test_fsdp_gpu.py runs: FSDP through the frameworks' own
wrapping, which needs an accelerator (Lightning's ``FSDPStrategy`` passes ``device_id=None`` on
CPU, which torch's FSDP1 refuses; Accelerate honours its FSDP plugin only on an accelerator, on
CPU it prepares DDP). ``lightning_fsdp1`` / ``fabric_fsdp1`` / ``accelerate_fsdp`` / ``trainer_fsdp`` run in the
test's own process as one rank (``world_size=1``: NCCL cannot put two ranks on one GPU) on
``device``; ``load_on_cpu`` is a rank function (gloo CPU ranks of the spawn harness) that loads
what they saved at another world size (DDP, and FSDP2 for Lightning's). Expected values come from the frameworks'
own checkpointing (and torch's full state dicts), never from unickpt."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from transformers import TrainingArguments

from tests.workers.accelerate_workers import GLOBAL_BATCH, SEQ, VOCAB, OursTrainer, StockTrainer, _llama, _Rows
from tests.workers.fabric_workers import StockFSDPStrategy as StockFabricFSDPStrategy
from tests.workers.lightning_workers import StockFSDPStrategy, Tiny
from unickpt.integrations.accelerate import load_state, save_state
from unickpt.integrations.lightning import (
    UnickptDDPStrategy,
    UnickptFabricFSDPStrategy,
    UnickptFSDPStrategy,
    UnickptModelParallelStrategy,
)

BACKENDS = ("unickpt", "stock")
SAVED_AT, STEPS = 3, 6  # Accelerate: saved after 3 steps, then 3 more


def _clean(name: str) -> str:
    """A parameter's name without FSDP1's wrapper prefixes."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def full_weights(root_module: nn.Module, module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s whole parameters on the CPU (FSDP1: gathered by torch's ``summon_full_params``
    over ``root_module``, the outermost FSDP module; other modules: as they are)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(root_module, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(root_module, writeback=False):
            return {_clean(k): v.detach().cpu().clone() for k, v in module.named_parameters()}
    return {_clean(k): _full(v).detach().cpu().clone() for k, v in module.named_parameters()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 (``DTensor``) parameter gathered by torch; others as they are."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# ---------------------------------------------------------------- Lightning, FSDPStrategy's wrapping


class WrappedByLightning(Tiny):
    """``Tiny`` left whole (``FSDPStrategy``'s ``auto_wrap_policy`` wraps it); records its weights
    when training starts (after a resume: what was loaded) and at the end of each epoch."""

    def __init__(self, fsdp2: bool = False) -> None:
        super().__init__(fsdp=fsdp2)  # fsdp2: configure_model applies fully_shard (ModelParallelStrategy)
        self.weights: dict[str, dict[str, torch.Tensor]] = {}

    def _record(self, when: str) -> None:
        self.weights[when] = full_weights(self.trainer.strategy.model, self)

    def on_train_start(self) -> None:
        self._record("start")

    def on_train_epoch_end(self) -> None:
        self._record(f"epoch{self.current_epoch}")

    def on_validation_start(self) -> None:
        self._record("validate")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def val_dataloader(self) -> Any:
        return self.train_dataloader()


def _lightning_strategy(backend: str, device: str) -> Any:
    """FSDP1 with Lightning's own wrapping: every ``nn.Linear`` in its own FSDP unit, then the root.
    Stock: Lightning's ``FSDPStrategy`` (its default full state dict); on CPU (only where FSDP1 is
    made to run there) its subclass that passes Lightning's GPU-only check."""
    policy = {nn.Linear}
    if backend == "unickpt":
        return UnickptFSDPStrategy(auto_wrap_policy=policy)
    return (L.pytorch.strategies.FSDPStrategy if device == "cuda" else StockFSDPStrategy)(auto_wrap_policy=policy)


def _lightning_fit(backend: str, device: str, dirpath: str, epochs: int, ckpt_path: str | None) -> WrappedByLightning:
    torch.manual_seed(0 if ckpt_path is None else 1)  # a resumed run's weights must come from the checkpoint
    model = WrappedByLightning()
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        strategy=_lightning_strategy(backend, device),
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=dirpath,
        callbacks=[
            ModelCheckpoint(dirpath=dirpath, filename="{epoch}", save_top_k=-1, every_n_epochs=1, save_last=True)
        ],
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def lightning_fsdp1(root: str, device: str) -> dict[str, Any]:
    """Per backend: ``fit`` 2 epochs (6 steps each) with a checkpoint per epoch, then a fresh module
    resumed from epoch 0 (``fit(ckpt_path=...)``, to 2 epochs) and from ``"last"`` (to 3 epochs).
    Returns losses and weights per backend; stock is Lightning's ``FSDPStrategy`` (full state dict)."""
    out: dict[str, Any] = {}
    for backend in BACKENDS:
        saved = os.path.join(root, "lightning", backend)
        trained = _lightning_fit(backend, device, saved, 2, None)
        from_epoch0 = _lightning_fit(backend, device, os.path.join(saved, "from-epoch0"), 2, f"{saved}/epoch=0.ckpt")
        from_last = _lightning_fit(backend, device, saved, 3, "last")
        out[backend] = {
            "losses": trained.losses,
            "epoch0": trained.weights["epoch0"],
            "epoch1": trained.weights["epoch1"],
            "from-epoch0/start": from_epoch0.weights["start"],
            "from-epoch0/losses": from_epoch0.losses,
            "from-last/start": from_last.weights["start"],
            "from-last/losses": from_last.losses,
        }
    return out


def _fabric_strategy(backend: str, device: str) -> Any:
    policy = {nn.Linear}
    if backend == "unickpt":
        return UnickptFabricFSDPStrategy(auto_wrap_policy=policy)
    return (FabricFSDPStrategy if device == "cuda" else StockFabricFSDPStrategy)(auto_wrap_policy=policy)


def _fabric_loop(backend: str, device: str, path: str, resume: bool) -> list[float]:
    """Fabric with its own FSDP1 wrapping: 3 steps, ``fabric.save``, 3 more steps; with ``resume``
    (another seed): ``fabric.load`` first, then 3 steps. Each step's batch is chosen by the step
    counter. Returns the losses."""
    fabric = L.Fabric(
        accelerator="cuda" if device == "cuda" else "cpu", devices=1, strategy=_fabric_strategy(backend, device)
    )
    fabric.launch()
    torch.manual_seed(1 if resume else 0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    if resume:
        fabric.load(path, state)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 4, generator=g).to(fabric.device), torch.randn(24, 1, generator=g).to(fabric.device)
    losses = []
    for i in range(3 if resume else 6):
        if i == 3:
            fabric.save(path, state)
        start = state["step"] * 4 % 24
        loss = torch.nn.functional.mse_loss(model(x[start : start + 4]), y[start : start + 4])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        state["step"] += 1
        losses.append(loss.item())
    return losses


def fabric_fsdp1(root: str, device: str) -> dict[str, Any]:
    """Per backend: the uninterrupted Fabric loop (saving after step 3) and the loop resumed from
    that save; stock is Fabric's own ``FSDPStrategy`` (its default sharded checkpoint)."""
    out: dict[str, Any] = {}
    for backend in BACKENDS:
        path = os.path.join(root, "fabric", backend, "step3")
        out[f"{backend}/losses"] = _fabric_loop(backend, device, path, False)
        out[f"{backend}/resumed"] = _fabric_loop(backend, device, path, True)
    return out


# ---------------------------------------------------------------- Accelerate, its FSDP plugin


def _plugin(version: int) -> FullyShardedDataParallelPlugin:
    """The plugin as a user sets it for a Llama: one FSDP unit per decoder layer; the rest default."""
    return FullyShardedDataParallelPlugin(
        fsdp_version=version,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )


def _accelerate(version: int, seed: int) -> tuple[Accelerator, Any, Any, Any]:
    AcceleratorState._reset_state(True)  # a fresh Accelerator (its state is a process-wide singleton)
    acc = Accelerator(fsdp_plugin=_plugin(version))
    model = _llama(seed)
    if version == 1:  # Accelerate's FSDP1 order: the optimizer over the wrapped model's (flat) parameters
        model = acc.prepare(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    if version == 1:
        opt, sched = acc.prepare(opt, sched)
    else:  # FSDP2: model and optimizer together
        model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def _accelerate_step(i: int, acc: Accelerator, model: Any, opt: Any, sched: Any) -> float:
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(i)).to(acc.device)
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.item()


def full_state(model: Any, opt: Any) -> dict[str, Any]:
    """torch's full (gathered, CPU) state dicts of a prepared model and its optimizer, keyed by
    parameter name: what a resume must reproduce bit-exactly."""
    inner = getattr(opt, "optimizer", opt)
    model_sd, opt_sd = get_state_dict(model, inner, options=StateDictOptions(full_state_dict=True))
    opt_sd["state"] = {k: {n: _cpu(v) for n, v in s.items()} for k, s in opt_sd["state"].items()}
    return {"model": {_clean(k): _cpu(v) for k, v in model_sd.items()}, "optimizer": opt_sd}


def _cpu(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def accelerate_fsdp(root: str, version: int) -> dict[str, Any]:
    """FSDP ``version`` (1 or 2) through Accelerate: 3 steps, ``save_state`` through unickpt and
    Accelerate's own ``accelerator.save_state``, 3 more steps; then per backend fresh objects
    (another seed) loaded from its checkpoint and 3 steps. Returns the full states at the save and
    after each load, the losses, and the distributed type Accelerate chose."""
    objs = _accelerate(version, 0)
    acc = objs[0]
    losses = [_accelerate_step(i, *objs) for i in range(SAVED_AT)]
    paths = {b: os.path.join(root, f"accelerate-v{version}", b) for b in BACKENDS}
    save_state(acc, paths["unickpt"])
    acc.save_state(paths["stock"])
    out: dict[str, Any] = {"fsdp": acc.distributed_type == DistributedType.FSDP, "is_fsdp2": acc.is_fsdp2}
    out["saved"] = full_state(objs[1], objs[2])
    out["losses"] = losses + [_accelerate_step(i, *objs) for i in range(SAVED_AT, STEPS)]
    for backend in BACKENDS:
        objs = _accelerate(version, 100)
        if backend == "unickpt":
            load_state(objs[0], paths[backend])
        else:
            objs[0].load_state(paths[backend])
        out[f"{backend}/loaded"] = full_state(objs[1], objs[2])
        out[f"{backend}/scheduler"] = objs[3].scheduler.state_dict()
        out[f"{backend}/losses"] = [_accelerate_step(i, *objs) for i in range(SAVED_AT, STEPS)]
    AcceleratorState._reset_state(True)
    return out


def trainer_fsdp(root: str, version: int) -> dict[str, Any]:
    """The HF Trainer with FSDP ``version`` (``TrainingArguments.fsdp``): per backend 6 steps with
    ``checkpoint-N`` every 2, then a fresh model resumed from ``checkpoint-4``
    (``resume_from_checkpoint=True`` in a folder holding only it): its steps 5 and 6."""
    import shutil

    out: dict[str, Any] = {}
    for backend in BACKENDS:
        folder = os.path.join(root, f"trainer-v{version}", backend)
        for resume in (False, True):
            AcceleratorState._reset_state(True)
            target = os.path.join(folder, "resumed") if resume else folder
            if resume:
                shutil.copytree(os.path.join(folder, "checkpoint-4"), os.path.join(target, "checkpoint-4"))
            args = TrainingArguments(
                output_dir=target,
                max_steps=STEPS,
                per_device_train_batch_size=GLOBAL_BATCH,
                learning_rate=1e-2,
                save_steps=2,
                report_to="none",
                disable_tqdm=True,
                logging_strategy="no",
                seed=0,
                fsdp=True,  # full shard, one unit per decoder layer
                fsdp_config={"version": version, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
            )
            cls = OursTrainer if backend == "unickpt" else StockTrainer
            trainer = cls(model=_llama(100 if resume else 0), args=args, train_dataset=_Rows())
            trainer.losses = []
            trainer.train(resume_from_checkpoint=True if resume else None)
            out[f"{backend}/{'resumed' if resume else 'losses'}"] = trainer.losses
            out[f"{backend}/fsdp"] = trainer.is_fsdp_enabled
    AcceleratorState._reset_state(True)
    return out


# ---------------------------------------------------------------- loaded elsewhere: gloo CPU ranks


def load_on_cpu(rank: int, ws: int, root: str, versions: str) -> dict[str, Any]:
    """This rank's view of the GPU-made unickpt checkpoints loaded at ``ws`` on the CPU: the Lightning
    FSDP1 checkpoint of epoch 0 by ``trainer.validate(ckpt_path=...)`` with ``UnickptDDPStrategy``
    and with ``UnickptModelParallelStrategy`` (FSDP2 shards of this world size); each Accelerate
    FSDP checkpoint by ``load_state`` into a CPU ``Accelerator`` (DDP). Returns the loaded full
    weights (and the Accelerate optimizers' state)."""
    out: dict[str, Any] = {}
    for name, strategy in (
        ("lightning", UnickptDDPStrategy()),
        ("lightning-fsdp2", UnickptModelParallelStrategy(data_parallel_size=ws, tensor_parallel_size=1)),
    ):
        torch.manual_seed(1)  # not the trained weights: they must come from the checkpoints
        model = WrappedByLightning(fsdp2=name == "lightning-fsdp2")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=ws,
            strategy=strategy,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.validate(model, ckpt_path=os.path.join(root, "lightning", "unickpt", "epoch=0.ckpt"))
        out[name] = model.weights["validate"]
    for version in versions.split(","):
        AcceleratorState._reset_state(True)
        acc = Accelerator(cpu=True)
        llama = _llama(7)
        opt = torch.optim.AdamW(llama.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        llama, opt, sched = acc.prepare(llama, opt, sched)
        load_state(acc, os.path.join(root, f"accelerate-v{version}", "unickpt"))
        out[f"accelerate-v{version}"] = full_state(llama, opt)
    AcceleratorState._reset_state(True)
    return out
