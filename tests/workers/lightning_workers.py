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


# ---------------------------------------------------------------- the RAM tier (issue 40)


def _fit_tier(ws: int, dirpath: str, epochs: int, ckpt_path: str | None, tier: bool) -> tuple[Tiny, Any]:
    """DDP ``Tiny`` to ``epochs`` epochs; with ``tier`` a checkpoint per epoch (and ``last.ckpt``)
    through the strategy's RAM tier (one replica per host, nothing due on the durable folder)."""
    torch.manual_seed(0 if ckpt_path is None else 1)  # a resumed run's weights come from the checkpoint
    model = Tiny(False)
    knobs = {"fast_root": "shm://ljob", "replicas": 1, "durable_every": 100, "keep_fast": 2} if tier else {}
    strategy = UnickptDDPStrategy(async_save=True, **knobs)
    callbacks = [ModelCheckpoint(dirpath=dirpath, filename="{epoch}-{step}", save_top_k=-1, every_n_epochs=1,
                                 save_last=True)] if tier else []  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        num_nodes=1,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=tier,
        default_root_dir=dirpath,
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, strategy.last_recovery


def trainer_on_the_ram_tier(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Rank r is on host "abc"[r] (its own RAM folder). An uninterrupted run of 3 epochs; a run on
    the tier for 2 epochs (a checkpoint per epoch, ``last.ckpt``); host b's RAM lost; a run resumed
    with ``ckpt_path="last"`` to 3 epochs: losses, the checkpoint folder, the resume's sources."""
    import shutil

    from tests.workers.recovery_workers import enter_host

    enter_host(root, "abc"[rank])
    out: dict[str, Any] = {}
    out["uninterrupted"] = _fit_tier(ws, os.path.join(root, "plain"), 3, None, False)[0].losses
    tiered = os.path.join(root, "tiered")
    out["first"] = _fit_tier(ws, tiered, 2, None, True)[0].losses
    out["files"] = {n: os.path.getsize(os.path.join(tiered, n)) for n in sorted(os.listdir(tiered))
                    if os.path.isfile(os.path.join(tiered, n))}  # fmt: skip
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(root, "ram", "b"))  # host b's RAM is gone
    torch.distributed.barrier()
    model, report = _fit_tier(ws, tiered, 3, "last", True)
    out["resumed"] = model.losses
    out["recovery"] = {"step": report.step, "tier": report.tier, "bytes": report.bytes_by_source}
    return out
