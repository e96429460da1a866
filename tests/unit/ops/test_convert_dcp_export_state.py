"""Issue 39 item 11: ``unickpt convert --to dcp`` writes every ``Stateful`` saved under its own key.

A job saves ``{"model", "optimizer", "lr_scheduler": sched, "train_state": ts, "dataloader": dl}``
(the README's form, and what ``integrations.torchtitan`` saves). The export must write
``lr_scheduler``, ``train_state`` and ``dataloader`` as torchtitan's DCP manager does
(``torchtitan/components/checkpointer/dcp.py``: ``_flattened_model_states_sd`` puts the model's FQNs
at the top level beside ``self.states``' other entries under their names, ``MODEL``,
``OPTIMIZER``, ``LR_SCHEDULER``, ``DATALOADER``, ``TRAIN_STATE`` from ``checkpointer/base.py``),
so ``dcp.load`` of the dict torchtitan's ``_states_to_load`` builds restores them; the default
layout writes them under their names beside ``model`` and ``optimizer``; and a round trip back
through ``convert --from dcp`` keeps them (in ``extra_state``, docs/migrating.md).

The objects are torchtitan's own (``OptimizersContainer`` from ``default_adamw``,
``LRSchedulersContainer``, ``ParallelAwareDataloader``) and torch's ``StepLR``; expected values come
from the live objects, never from the converter.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torchtitan.components.checkpoint import DATALOADER, LR_SCHEDULER, OPTIMIZER, TRAIN_STATE, ModelWrapper
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

import unickpt
from unickpt.ops.convert import from_dcp, to_dcp
from unickpt.ops.dcp_layouts import ImportedLoaderState


class TrainState:
    """torchtitan's ``Trainer`` as its checkpoint sees it (``states={"train_state": self}``), with a
    tensor as a user's train state may hold one (saved by unickpt as a checkpoint tensor)."""

    def __init__(self, step: int = 0, ntokens_seen: int = 0) -> None:
        self.step, self.ntokens_seen = step, ntokens_seen
        self.loss_ema = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen, "loss_ema": self.loss_ema}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]
        self.loss_ema = sd["loss_ema"]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _titan_job(seed: int, steps: int) -> dict[str, Any]:
    """torchtitan's objects, trained ``steps`` real steps (the dataloader consumed ``steps`` batches;
    ``"batches"``: its live iterator, whose next batch a resumed loader must give)."""
    model = _model(seed)
    optimizers = default_adamw(lr=0.01).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    loader = ParallelAwareDataloader(list(range(64)), dp_rank=0, dp_world_size=1, batch_size=4)
    batches = iter(loader)
    for _ in range(steps):
        x = next(batches).float().reshape(1, 4)
        model(x).square().sum().backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
    train = TrainState(steps, 4 * steps)
    train.loss_ema = torch.tensor([0.5, 0.25, float(steps)])
    job = {"model": model, OPTIMIZER: optimizers, LR_SCHEDULER: schedulers, DATALOADER: loader, TRAIN_STATE: train}
    return {**job, "batches": batches}


def _save_as_integration(job: dict[str, Any], path: Path) -> None:
    """What ``integrations.torchtitan.UnickptCheckpointManager`` hands ``unickpt.save``."""
    state = {k: v for k, v in job.items() if k != "batches"}
    state["model"] = [job["model"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's set_vital deprecation
        unickpt.save(str(path), state)


def _dcp_load(state: dict[str, Any], folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)  # no allow_partial_load


def _next_batch(loader: ParallelAwareDataloader) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return next(iter(loader))


def test_issue39_item11_torchtitan_layout_writes_lr_scheduler_train_state_dataloader(tmp_path):
    job = _titan_job(0, steps=3)
    _save_as_integration(job, tmp_path / "ck")
    result = to_dcp(str(tmp_path / "ck"), str(tmp_path / "step-3"), layout="torchtitan")
    assert result.skipped == (), result.skipped  # today: "lr_scheduler/replicated (state of another rank ...)"

    keys = set(dcp.FileSystemReader(str(tmp_path / "step-3")).read_metadata().state_dict_metadata)
    assert {"lr_scheduler.last_epoch", "train_state.step", "train_state.ntokens_seen"} <= keys
    assert {"dataloader.dp_rank_0", "dataloader.world_size"} <= keys

    fresh = _titan_job(1, steps=0)
    # torchtitan's CheckpointManager._states_to_load: the model's FQNs at the top level, the rest by name
    states = {**ModelWrapper([fresh["model"]]).state_dict()}
    states.update({k: fresh[k] for k in (OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE)})
    _dcp_load(states, tmp_path / "step-3")

    want_sched = job[LR_SCHEDULER].state_dict()
    assert want_sched == {"last_epoch": 3}
    assert fresh[LR_SCHEDULER].state_dict() == want_sched
    assert fresh[LR_SCHEDULER].schedulers[0].get_last_lr() == job[LR_SCHEDULER].schedulers[0].get_last_lr()
    assert (fresh[TRAIN_STATE].step, fresh[TRAIN_STATE].ntokens_seen) == (3, 12)
    assert torch.equal(fresh[TRAIN_STATE].loss_ema, job[TRAIN_STATE].loss_ema)
    assert torch.equal(_next_batch(fresh[DATALOADER]), next(job["batches"]))  # resumes at the 4th batch
    for (k, v), w in zip(job["model"].state_dict().items(), fresh["model"].state_dict().values()):
        assert torch.equal(v, w), k


def test_issue39_item11_state_dict_layout_writes_statefuls_under_their_keys(tmp_path):
    model = _model(0)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
    train = TrainState(5, 20)
    train.loss_ema = torch.tensor([1.0, 2.0, 3.0])
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        sched.step()
    unickpt.save(str(tmp_path / "ck"), {"model": model, "optimizer": optim, "lr_scheduler": sched, "train": train})
    result = to_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"))
    assert result.skipped == (), result.skipped

    fresh = _model(1)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_optim, 1, gamma=0.5)
    fresh_train = TrainState()
    state = {"lr_scheduler": fresh_sched, "train": fresh_train}  # DCP calls their load_state_dict
    _dcp_load(state, tmp_path / "dcp")
    assert fresh_sched.state_dict() == sched.state_dict()
    assert (fresh_train.step, fresh_train.ntokens_seen) == (5, 20)
    assert torch.equal(fresh_train.loss_ema, train.loss_ema)


def test_issue39_item11_round_trip_through_dcp_keeps_them(tmp_path):
    job = _titan_job(0, steps=3)
    _save_as_integration(job, tmp_path / "ck")
    to_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"), layout="torchtitan")
    from_dcp(str(tmp_path / "dcp"), str(tmp_path / "back"))
    loader = ImportedLoaderState(None)
    state: dict[str, Any] = {"extra_state": None, "dataloader": loader}
    unickpt.load(str(tmp_path / "back"), state, strict=False)
    extra = state["extra_state"]
    assert extra[LR_SCHEDULER] == job[LR_SCHEDULER].state_dict()
    assert {k: extra[TRAIN_STATE][k] for k in ("step", "ntokens_seen")} == {"step": 3, "ntokens_seen": 12}
    assert torch.equal(extra[TRAIN_STATE]["loss_ema"], job[TRAIN_STATE].loss_ema)
    fresh_loader = _titan_job(1, steps=0)[DATALOADER]
    fresh_loader.load_state_dict(loader.state)  # torchtitan's own loader takes the imported state
    assert torch.equal(_next_batch(fresh_loader), next(job["batches"]))

    # the default layout: a scheduler saved under its own key comes back too
    model = _model(0)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
    optim.step()
    sched.step()
    unickpt.save(str(tmp_path / "ck2"), {"model": model, "lr_scheduler": sched})
    to_dcp(str(tmp_path / "ck2"), str(tmp_path / "dcp2"))
    from_dcp(str(tmp_path / "dcp2"), str(tmp_path / "back2"))
    fresh = _model(1)
    state = {"model": fresh, "extra_state": None}
    unickpt.load(str(tmp_path / "back2"), state, strict=False)
    assert state["extra_state"] == {"lr_scheduler": sched.state_dict()}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_issue39_item11_every_dp_ranks_loader_state_in_one_entry():
    """torchtitan's DCP manager writes every DP rank's ``dp_rank_<r>`` into one ``dataloader``
    entry; unickpt keeps them per rank (``dataloader/rank<r>``): the export merges them, and keeps
    rank 0's (listing the others) when ranks give one name different values."""
    from unickpt.ops.dcp_layouts import _merged_loader  # today: only rank 0's state is read

    ranks = {r: {f"dp_rank_{r}": bytes([r]) * 4, "world_size": 2} for r in range(2)}
    merged, skipped = _merged_loader(ranks)
    assert merged == {"dp_rank_0": b"\0" * 4, "dp_rank_1": b"\1" * 4, "world_size": 2} and skipped == []
    clash = {0: {"epoch": 1}, 1: {"epoch": 2}}
    first, skipped = _merged_loader(clash)
    assert first == {"epoch": 1} and skipped == ["dataloader/rank1 (state of another rank: the export keeps rank 0's)"]


class _Holder:
    """A user's Stateful whose state holds a dict shaped like unickpt's tensor placeholder (item 5)."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"box": self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["box"]


def test_issue39_item11_escaped_user_dicts_and_scheduler_lists_reach_dcp_as_saved(tmp_path):
    """The export joins a Stateful's blob under the checkpoint's own encoding: a user dict shaped like
    a placeholder arrives in DCP as the user's dict (not as the escape), and a list of schedulers under
    one key (item 9) as the list of their states."""
    model = _model(0)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheds = [torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5), torch.optim.lr_scheduler.LinearLR(optim)]
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        for s in scheds:
            s.step()
    user_dict = {"__unickpt_tensor__": "model.0.weight"}
    unickpt.save(
        str(tmp_path / "ck"),
        {"model": model, "optimizer": optim, "lr_scheduler": scheds, "holder": _Holder(dict(user_dict))},
    )
    to_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"))

    holder = _Holder({"__unickpt_tensor__": None})  # DCP loads into the structure it is given
    fresh_optim = torch.optim.AdamW(_model(1).parameters(), lr=0.1)
    fresh = [torch.optim.lr_scheduler.StepLR(fresh_optim, 1, gamma=0.5), torch.optim.lr_scheduler.LinearLR(fresh_optim)]
    state: dict[str, Any] = {"holder": holder, "lr_scheduler": [s.state_dict() for s in fresh]}
    _dcp_load(state, tmp_path / "dcp")
    assert holder.value == {"__unickpt_tensor__": "model.0.weight"}
    assert state["lr_scheduler"] == [s.state_dict() for s in scheds]
