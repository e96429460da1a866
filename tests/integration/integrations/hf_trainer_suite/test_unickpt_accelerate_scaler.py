"""unickpt's own regression test beside the Trainer's: ``accelerator.scaler``, the fp16
``GradScaler`` Accelerate builds on a GPU, saved by ``unickpt.integrations.accelerate.save_state``
and loaded by ``load_state``. Accelerate makes no scaler on CPU (fp16 there is refused), so the
test gives the ``Accelerator`` a real ``torch.amp.GradScaler("cpu")`` as ``accelerator.scaler``
before ``prepare`` (as Accelerate's ``__init__`` would: ``prepare`` hands it to the
``AcceleratedOptimizer``, whose ``step`` calls ``scaler.step`` and ``scaler.update``), trains it
into a scale and growth tracker of its own (two overflowing steps, then a good one), and loads
the same save into a fresh accelerator and scaler through unickpt and through Accelerate's own
``save_state`` / ``load_state``: the expected values are what Accelerate's own load gives."""

from __future__ import annotations

import math
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from unickpt.integrations.accelerate import load_state, save_state

INIT_SCALE, GROWTH_INTERVAL = 2.0**12, 2
OVERFLOWS = (False, True, True, False)  # steps whose gradients overflow: the scale backs off twice


def _accelerator() -> tuple[Accelerator, nn.Module, Any]:
    accelerator = Accelerator(cpu=True)
    assert accelerator.scaler is None  # Accelerate builds none on CPU
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _step(accelerator: Accelerator, model: nn.Module, optimizer: Any, overflow: bool) -> None:
    x = torch.tensor([[1.0, 2.0, 3.0]])
    loss = model(x).sum() * (math.inf if overflow else 1.0)
    accelerator.backward(loss)  # scaler.scale(loss).backward()
    optimizer.step()  # scaler.step (skipped on overflow), scaler.update
    optimizer.zero_grad()


def test_scaler_state_loads_as_with_accelerates_own_load(tmp_path) -> None:
    accelerator, model, optimizer = _accelerator()
    for overflow in OVERFLOWS:
        _step(accelerator, model, optimizer, overflow)
    saved = accelerator.scaler.state_dict()
    assert (saved["scale"], saved["_growth_tracker"]) == (INIT_SCALE / 4, 1)  # not the fresh scaler's
    save_state(accelerator, str(tmp_path / "unickpt"))
    accelerator.save_state(str(tmp_path / "accelerate"))

    ours, our_model, our_optimizer = _accelerator()
    load_state(ours, str(tmp_path / "unickpt"))
    theirs, their_model, their_optimizer = _accelerator()
    theirs.load_state(str(tmp_path / "accelerate"))
    assert ours.scaler.state_dict() == theirs.scaler.state_dict() == saved

    # the loaded scale and growth tracker drive the next steps as Accelerate's: one good step grows the scale
    for overflow in (False, True, False):
        _step(ours, our_model, our_optimizer, overflow)
        _step(theirs, their_model, their_optimizer, overflow)
        assert ours.scaler.state_dict() == theirs.scaler.state_dict()
    for mine, stock in zip(our_model.parameters(), their_model.parameters(), strict=True):
        assert torch.equal(mine, stock)
