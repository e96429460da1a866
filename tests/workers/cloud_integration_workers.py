"""Rank functions of tests/integration/integrations/test_cloud_paths_processes.py: the trainer
integrations with a ``gs://`` / ``az://`` checkpoint path (the emulator's endpoint and
credentials reach the ranks through the environment the test set). Lightning is imported inside
its worker: imported beside verl's FSDP2 it broke ``fully_shard`` of the Llama's embedding."""

from __future__ import annotations

from typing import Any

import torch


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def lightning_on_url(rank: int, ws: int, url: str) -> dict[str, Any]:
    """Trainer: 2 epochs uninterrupted, saving ``url/epoch0`` after the first; a fresh module
    resumed from it for the second; then ``url/gone`` saved and removed with the strategy's
    ``remove_checkpoint``. Fabric: 3 steps saved to ``url/fabric``, resumed for 2, against 5
    uninterrupted steps."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from tests.workers.fabric_workers import fabric_run
    from tests.workers.lightning_workers import Tiny
    from unickpt.integrations.lightning import UnickptDDPStrategy

    class SaveAfterFirstEpoch(Callback):
        """``trainer.save_checkpoint(path)`` at the end of epoch 0 (where ``ModelCheckpoint`` saves)."""

        def __init__(self, path: str) -> None:
            self.path = path

        def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(self.path)

    def make_trainer(callbacks: list[Any]) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu",
            devices=ws,
            num_nodes=1,
            strategy=UnickptDDPStrategy(async_save=True),
            max_epochs=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=callbacks,
        )

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    whole = Tiny(False)
    make_trainer([SaveAfterFirstEpoch(f"{url}/epoch0")]).fit(whole)
    out["whole"], out["whole_params"] = whole.losses, _params(whole)

    torch.manual_seed(1)  # other weights: the resumed ones must come from the checkpoint
    resumed = Tiny(False)
    trainer = make_trainer([])
    trainer.fit(resumed, ckpt_path=f"{url}/epoch0")
    out["resumed"], out["resumed_params"] = resumed.losses, _params(resumed)

    trainer.save_checkpoint(f"{url}/gone")
    trainer.strategy.checkpointer.wait()
    trainer.strategy.barrier()
    trainer.strategy.remove_checkpoint(f"{url}/gone")
    trainer.strategy.barrier()

    out["fabric_whole"] = fabric_run("ddp", "unickpt", rank, ws, f"{url}/fabric5", False, 5)
    fabric_run("ddp", "unickpt", rank, ws, f"{url}/fabric", False, 3)
    out["fabric_resumed"] = fabric_run("ddp", "unickpt", rank, ws, f"{url}/fabric", True, 2)
    return out


def verl_on_url(rank: int, ws: int, url: str) -> dict[str, Any]:
    """verl's manager (installed as verl's engine finds it) saving ``url/global_step_{1,2}/actor``
    (step 2 with ``hf_model``, ``max_ckpt_to_keep=1``: step 1 removed), then a fresh model resumed
    from step 2 after the saved one moved on."""
    from tests.workers.verl_workers import _snapshot_keeping_rng, build, snapshot, train_step
    from unickpt.integrations.verl import install

    install()
    t = build()
    m = t["manager"]
    for step in (1, 2):
        train_step(t, step)
        if step == 2:
            m.checkpoint_save_contents = ["model", "optimizer", "extra", "hf_model"]
            out: dict[str, Any] = {"saved": _snapshot_keeping_rng(t)}  # what this save must hold
        m.save_checkpoint(f"{url}/global_step_{step}/actor", global_step=step, max_ckpt_to_keep=1)
    fresh = build(seed=5)
    fresh["manager"].load_checkpoint(f"{url}/global_step_2/actor")
    out["resumed"] = snapshot(fresh)
    return out


def torchtitan_on_url(rank: int, ws: int, url: str) -> dict[str, Any]:
    """torchtitan's objects (FSDP2) with ``UnickptCheckpointManager`` and ``base_folder=url``:
    6 steps, async saves at 2, 4, 6 keeping the newest 2; a fresh set resumed from the newest."""
    from tests.workers.torchtitan_workers import SAVE_STEPS, build, snapshot, train_step

    t = build(url, interval=2, keep_latest_k=2, async_mode="async")
    out: dict[str, Any] = {"fresh_load": t["manager"].load()}
    for _ in range(SAVE_STEPS):
        train_step(t)
    out["saved"] = snapshot(t)
    t["manager"].maybe_wait_for_saving()
    t["manager"].close()
    t2 = build(url, interval=2, keep_latest_k=2)
    out["loaded"] = t2["manager"].load()
    out["resumed"] = snapshot(t2)
    t2["manager"].close()
    return out
