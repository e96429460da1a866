"""What the vendored Lightning tests (``test_lightning_upstream_*.py`` here) need to run against
unickpt's strategies instead of Lightning's default one.

``use_unickpt_strategy`` (the ``conftest.py`` fixture calls it) wraps ``Trainer.__init__`` and
``Fabric.__init__``: a Trainer or Fabric built with no strategy (or ``"auto"``) gets
``UnickptDDPStrategy`` / ``UnickptFabricDDPStrategy`` on the CPU with one device (one process, a
world of 1 on gloo), with ``async_save`` as the parametrisation says; Fabric's ``"ddp_spawn"`` is
replaced the same way (in this process: the multi-process Trainer and Fabric runs are
tests/integration/integrations/test_lightning.py); a test that names another strategy keeps it.
The upstream tests then run unchanged except where marked ``# unickpt:``,
which replace reading Lightning's single ``.ckpt`` file (``os.path.isfile``, ``torch.load``) by
the two helpers below, which read the unickpt checkpoint folder instead.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.fabric as lf
import lightning.pytorch as pl

import unickpt
from unickpt.format.records import METADATA_FILE
from unickpt.format.values import loads_value
from unickpt.integrations.lightning import (
    LIGHTNING_KEY,
    UnickptDDPStrategy,
    UnickptFabricDDPStrategy,
    _LightningDict,
)

__all__ = ["is_checkpoint", "read_checkpoint", "use_unickpt_strategy"]


def use_unickpt_strategy(monkeypatch: Any, async_save: bool) -> None:
    """Make unickpt's DDP strategies the default of every Trainer / Fabric the test builds."""
    trainer_init, fabric_init = pl.Trainer.__init__, lf.Fabric.__init__

    def trainer(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("strategy", "auto") == "auto":
            kwargs.update(strategy=UnickptDDPStrategy(async_save=async_save), accelerator="cpu")
            kwargs.setdefault("devices", 1)
        trainer_init(self, *args, **kwargs)

    def fabric(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("strategy", "auto") in ("auto", "ddp_spawn"):  # in this process: one device
            kwargs.update(strategy=UnickptFabricDDPStrategy(async_save=async_save), accelerator="cpu", devices=1)
        fabric_init(self, *args, **kwargs)

    monkeypatch.setattr(pl.Trainer, "__init__", trainer)
    monkeypatch.setattr(lf.Fabric, "__init__", fabric)


def is_checkpoint(path: Any) -> bool:
    """What ``os.path.isfile(ckpt)`` asks of Lightning's file: is there a (committed) unickpt checkpoint."""
    unickpt.wait_all()  # an async save at this path is done
    return os.path.isfile(os.path.join(str(path), METADATA_FILE))


def read_checkpoint(path: Any, model: Any = None) -> dict[str, Any]:
    """What ``torch.load(ckpt)`` returns for Lightning's file: its dict (loops, callbacks, epoch,
    global step, schedulers ...) from the unickpt checkpoint; with ``model``, its parameters are
    loaded into that module and returned as ``"state_dict"``."""
    unickpt.wait_all()
    holder = _LightningDict()
    state: dict[str, Any] = {LIGHTNING_KEY: holder}
    if model is not None:
        state["model"] = model
    unickpt.load(str(path), state, strict=False)
    checkpoint = loads_value(holder.data, str(path))
    if model is not None:
        checkpoint["state_dict"] = model.state_dict()
    return checkpoint
