"""The ``Checkpointer`` object: what it owns, and that two of them never wait on each other.

Actor and critic (PPO-style): two models, two optimizers, two checkpointers saving
asynchronously at once. The actor's background snapshot is held on a gate that only the test
opens; the critic's save, its optimizer step and its commit must all complete while the gate is
closed (a shared snapshot thread or step guard would deadlock them: the test would time out).

Its tests that start processes are in ``tests/integration/engine/test_checkpointer_processes.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import unickpt
from tests.support.compare import same_state


def _model(seed: int, width: int = 64) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(model, optim, seed)
    return model, optim


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 16, generator=g)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Reference copy with torch's own state_dict APIs."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in optim.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _gate(ckpt: unickpt.Checkpointer) -> threading.Event:
    """Hold ``ckpt``'s snapshot thread until the returned event is set (a task queued ahead of
    any background copy of that checkpointer)."""
    gate = threading.Event()
    ckpt.resources.staging._snapshotter.submit(gate.wait)
    return gate


def _load(path: str, seed: int) -> dict[str, torch.Tensor]:
    model, optim = _model(seed + 100)
    unickpt.Checkpointer().load(path, {"model": model, "optimizer": optim})
    return _state(model, optim)


def test_two_checkpointers_save_async_at_once_without_waiting_on_each_other(tmp_path):
    actor, actor_opt = _model(1)
    critic, critic_opt = _model(2)
    with unickpt.Checkpointer() as a_ckpt, unickpt.Checkpointer() as c_ckpt:
        gate = _gate(a_ckpt)
        try:
            want_actor, want_critic = _state(actor, actor_opt), _state(critic, critic_opt)
            a_handle = a_ckpt.save(str(tmp_path / "actor"), {"model": actor, "optimizer": actor_opt}, async_save=True)
            c_handle = c_ckpt.save(
                str(tmp_path / "critic"), {"model": critic, "optimizer": critic_opt}, async_save=True
            )
            _step(critic, critic_opt, 3)  # must not wait for the actor's held snapshot
            c_handle.wait()  # the critic commits while the actor's copy is still held
            assert not a_handle.done()
            assert same_state(_load(str(tmp_path / "critic"), 2), want_critic)
        finally:
            gate.set()
        _step(actor, actor_opt, 4)  # waits for the actor's snapshot (now released), then steps
        a_handle.wait()
    assert same_state(_load(str(tmp_path / "actor"), 1), want_actor)
    assert not same_state(_state(actor, actor_opt), want_actor)  # the step after the save did run


def test_one_checkpointer_steps_wait_only_for_their_own_optimizer(tmp_path):
    """Within one checkpointer the guard is per optimizer: a step of an optimizer that was not
    saved never waits for another optimizer's snapshot."""
    saved, saved_opt = _model(5)
    other, other_opt = _model(6)
    with unickpt.Checkpointer() as ckpt:
        gate = _gate(ckpt)
        try:
            h = ckpt.save(str(tmp_path / "s"), {"model": saved, "optimizer": saved_opt}, async_save=True)
            _step(other, other_opt, 7)  # not guarded by this save: returns while the gate is closed
            assert not h.done()
        finally:
            gate.set()
        h.wait()


def test_checkpointer_close_drains_its_saves_and_frees_its_memory(tmp_path):
    model, optim = _model(8)
    ckpt = unickpt.Checkpointer()
    want = _state(model, optim)
    h = ckpt.save(str(tmp_path / "c"), {"model": model, "optimizer": optim}, async_save=True)
    ckpt.close()
    assert h.done() and ckpt.closed
    assert ckpt.resources.staging.capacity_bytes() == 0
    assert same_state(_load(str(tmp_path / "c"), 8), want)
    with pytest.raises(unickpt.CheckpointError, match="closed"):
        ckpt.save(str(tmp_path / "again"), {"model": model})
    ckpt.close()  # idempotent


def test_checkpointers_have_their_own_listeners_and_plan_caches(tmp_path):
    model, _ = _model(9)
    seen: dict[str, list[str]] = {"a": [], "b": []}
    a = unickpt.Checkpointer(listeners=[lambda ev: seen["a"].append(ev.phase)])
    b = unickpt.Checkpointer()
    b.events.add_listener(lambda ev: seen["b"].append(ev.phase))
    try:
        a.save(str(tmp_path / "a"), {"model": model})
        assert "save.end" in seen["a"] and not seen["b"]
        b.save(str(tmp_path / "b"), {"model": model})
        assert seen["b"].count("save.end") == 1 and seen["a"].count("save.end") == 1
        assert len(a.resources.plans._plans) == 1 and len(b.resources.plans._plans) == 1
    finally:
        a.close()
        b.close()


def test_wait_all_reports_failures_of_every_open_checkpointer(tmp_path):
    model, _ = _model(10)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with unickpt.Checkpointer() as ckpt:
        ckpt.save(str(blocker / "ck"), {"model": model}, async_save=True)
        with pytest.raises(unickpt.AsyncSaveFailures) as info:
            unickpt.wait_all()
        assert str(blocker / "ck") in str(info.value)


def test_manager_handle_waits_for_its_snapshot(tmp_path):
    """``CheckpointManager.save(...).wait_snapshot()`` waits for the save's own snapshot (it was a
    no-op: the manager's handle wraps the save, so an in-place change after it failed the save
    with SnapshotConflictError). The checkpoint holds the values at the call."""
    model, optim = _model(3)
    want = _state(model, optim)
    manager = unickpt.CheckpointManager(str(tmp_path / "run"), keep_last=2)
    handle = manager.save(1, {"model": model, "optimizer": optim}, async_save=True)
    handle.wait_snapshot()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    manager.wait()
    fresh, fresh_optim = _model(4)
    assert manager.load_latest({"model": fresh, "optimizer": fresh_optim}) == 1
    got = _state(fresh, fresh_optim)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
