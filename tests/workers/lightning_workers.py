"""Rank functions of tests/integration/integrations/test_lightning.py: a tiny LightningModule trained by a real
``lightning.Trainer`` (DDP, FSDP2 through ``ModelParallelStrategy``, or FSDP1 through
``FSDPStrategy``: ``kinds``), then a Fabric loop
(``fabric_workers``), on gloo ranks spawned by the harness (Lightning sees ``LOCAL_RANK`` /
``WORLD_SIZE`` and launches nothing itself), with unickpt's strategies or with stock
Lightning's own checkpointing, side by side in one spawn."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from tests.workers.fabric_workers import fabric_run
from unickpt.integrations.lightning import UnickptDDPStrategy, UnickptFSDPStrategy, UnickptModelParallelStrategy

KINDS = ("ddp", "fsdp2")  # test_lightning's main test; "fsdp1" (FSDPStrategy) has its own test (same spawns)
BACKENDS = ("unickpt", "stock")
SAMPLES, BATCH = 24, 4  # 3 steps per epoch at ws=2, 2 at ws=3, 6 at ws=1


class Tiny(L.LightningModule):
    def __init__(self, fsdp: bool, fsdp1: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.losses: list[float] = []
        self.loaded_keys: list[str] = []  # of checkpoint["state_dict"] in on_load_checkpoint

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_keys = sorted(checkpoint.get("state_dict", {}))

    def configure_model(self) -> None:
        if self.hparams.fsdp1 and not isinstance(self.net, FullyShardedDataParallel):
            # wrapped here, on the CPU device: Lightning's own wrapping passes device_id=None, which
            # torch's FSDP1 refuses without an accelerator ("FSDP needs a non-CPU accelerator device")
            cpu = torch.device("cpu")
            for i, layer in enumerate(self.net):
                if isinstance(layer, nn.Linear):
                    self.net[i] = FullyShardedDataParallel(layer, device_id=cpu, use_orig_params=True)
            self.net = FullyShardedDataParallel(self.net, device_id=cpu, use_orig_params=True)
        if self.hparams.fsdp:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class TinyVal(Tiny):
    """``Tiny`` with a validation loop (only for ``trainer.validate``: ``fit`` runs none)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.losses.append(F.mse_loss(self.net(x), y).item())

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


def validate(kind: str, backend: str, ws: int, ckpt: str) -> list[float]:
    """``trainer.validate(ckpt_path=ckpt)`` with a fresh module: its losses."""
    torch.manual_seed(1)  # not the trained weights: they must come from the checkpoint
    model = TinyVal(kind == "fsdp2", kind == "fsdp1")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        num_nodes=1,
        strategy=_strategy(kind, backend, ws),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.validate(model, ckpt_path=ckpt)
    return model.losses


class StockFSDPStrategy(L.pytorch.strategies.FSDPStrategy):
    """Lightning's own ``FSDPStrategy``, unchanged: a subclass only because Lightning's accelerator
    connector refuses ``type(strategy) is FSDPStrategy`` without a GPU accelerator. Used with
    ``state_dict_type="sharded"`` (torch DCP, every rank writes): with ``"full"`` (its default) its
    save on 2 CPU gloo ranks broke off (rank 1 left waiting in the full state dict's all_gather)."""


def _strategy(kind: str, backend: str, ws: int) -> Any:
    if kind == "fsdp1":
        # the module wraps itself (Tiny.configure_model)
        return UnickptFSDPStrategy() if backend == "unickpt" else StockFSDPStrategy(state_dict_type="sharded")
    if kind == "ddp":
        return UnickptDDPStrategy(async_save=True) if backend == "unickpt" else L.pytorch.strategies.DDPStrategy()
    cls = UnickptModelParallelStrategy if backend == "unickpt" else L.pytorch.strategies.ModelParallelStrategy
    return cls(data_parallel_size=ws, tensor_parallel_size=1)


def _fit(kind: str, backend: str, ws: int, dirpath: str, epochs: int, ckpt_path: str | None) -> Tiny:
    torch.manual_seed(0)
    model = Tiny(kind == "fsdp2", kind == "fsdp1")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        num_nodes=1,
        strategy=_strategy(kind, backend, ws),
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=dirpath,
        callbacks=[
            ModelCheckpoint(dirpath=dirpath, filename="{epoch}", save_top_k=-1, every_n_epochs=1, save_last=True),
            # keeps only the newest: every save after the first removes the one before
            ModelCheckpoint(dirpath=os.path.join(dirpath, "latest"), filename="{step}", every_n_train_steps=3),
        ],
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def train(rank: int, ws: int, root: str, kinds: str = ",".join(KINDS)) -> dict[str, Any]:
    """ws=2: 2 epochs, a checkpoint per epoch (and the newest-only callback), per kind and backend;
    then the Fabric loop: 3 steps and ``fabric.save``."""
    out: dict[str, Any] = {}
    for kind in kinds.split(","):
        for backend in BACKENDS:
            model = _fit(kind, backend, ws, os.path.join(root, kind, backend), 2, None)
            out[f"{kind}/{backend}"] = model.losses
            path = _fabric(root, kind, backend)
            out[f"fabric-{kind}/{backend}"] = fabric_run(kind, backend, rank, ws, path, False, 3)
    return out


def _fabric(root: str, kind: str, backend: str) -> str:
    return os.path.join(root, "fabric", kind, backend, "step3")


def resume(rank: int, ws: int, root: str, which: str, kinds: str = ",".join(KINDS)) -> dict[str, Any]:
    """``which="epoch0"``: fit(ckpt_path=<epoch=0 checkpoint>) to 2 epochs, saving elsewhere;
    ``"last"``: fit(ckpt_path="last") in the same folders to 3 epochs. Then the Fabric loop
    resumes from its step-3 checkpoint for 2 steps."""
    out: dict[str, Any] = {}
    for kind in kinds.split(","):
        for backend in BACKENDS:
            saved = os.path.join(root, kind, backend)
            if which == "last":
                model = _fit(kind, backend, ws, saved, 3, "last")
                out[f"validate-{kind}/{backend}"] = validate(kind, backend, ws, os.path.join(saved, "epoch=2.ckpt"))
            else:
                ckpt = os.path.join(saved, "epoch=0.ckpt")
                model = _fit(kind, backend, ws, os.path.join(saved, f"ws{ws}"), 2, ckpt)
            out[f"{kind}/{backend}"] = model.losses
            out[f"keys-{kind}/{backend}"] = model.loaded_keys
            out[f"fabric-{kind}/{backend}"] = fabric_run(kind, backend, rank, ws, _fabric(root, kind, backend), True, 2)
    return out
