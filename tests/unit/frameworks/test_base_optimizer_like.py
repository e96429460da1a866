"""Optimizers by duck type: wrappers that are not ``torch.optim.Optimizer`` (like Megatron's
optimizer wrappers or an LR-scheduled wrapper) save and load bit-exact, also resharded from
FSDP2 on 2 ranks to torch on 1; objects that do not fulfil the contract are refused clearly.
References come from the test oracle (``support.reference.full_state``, gathered with torch's
own APIs) and from the uninterrupted run's next loss.

Its tests that start processes are in ``tests/integration/frameworks/test_optimizer_like_processes.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import unickpt
from tests.support.reference import full_state
from unickpt.errors import FrameworkError
from unickpt.frameworks import is_optimizer_like, supports_step_hooks
from unickpt.testing.toy import build, train_step

STEPS = 2


class ScheduledAdam:
    """Delegates ``param_groups`` / ``state`` to an inner AdamW and decays the learning rate at
    every step: an optimizer by contract, not by class (no ``defaults``, no step hooks)."""

    def __init__(self, inner: torch.optim.Optimizer, decay: float = 0.5) -> None:
        self.inner, self.decay = inner, decay

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def step(self) -> None:
        self.inner.step()
        for g in self.inner.param_groups:
            g["lr"] *= self.decay

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.inner.load_state_dict(sd)


class HookedScheduledAdam(ScheduledAdam):
    """``ScheduledAdam`` with its own step pre-hooks (so async saves may copy in background)."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        super().__init__(inner)
        self.hooks: list[Callable[..., None]] = []
        self.hook_calls = 0

    def register_step_pre_hook(self, hook: Callable[..., None]) -> None:
        self.hooks.append(hook)

    def step(self) -> None:
        for h in self.hooks:
            self.hook_calls += 1
            h(self, (), {})
        super().step()


def _groups(optim: Any) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]


def _trained(framework: str, wrapper: type[ScheduledAdam] = ScheduledAdam) -> tuple[Any, ScheduledAdam]:
    model, inner = build(framework, seed=0)
    optim = wrapper(inner)
    for s in range(STEPS):
        train_step(model, optim, s)  # type: ignore[arg-type]
    return model, optim


def _save(rank: int, ws: int, framework: str, ckpt: str) -> dict:
    model, optim = _trained(framework)
    assert not isinstance(optim, torch.optim.Optimizer)
    unickpt.save(ckpt, {"model": model, "optimizer": optim}, framework=framework).wait()
    ref = full_state(model, optim)  # type: ignore[arg-type]
    groups = _groups(optim)
    return {"state": ref if rank == 0 else None, "groups": groups, "loss": train_step(model, optim, STEPS)}  # type: ignore[arg-type]


def _load(framework: str, ckpt: str, ref: dict) -> dict:
    model, inner = build(framework, seed=1234)  # a different init: everything must come from ckpt
    optim = ScheduledAdam(inner)
    unickpt.load(ckpt, {"model": model, "optimizer": optim}, framework=framework)
    got = full_state(model, optim)  # type: ignore[arg-type]
    return {
        "mismatched": sorted(k for k in ref["state"] if not torch.equal(got.get(k, torch.empty(0)), ref["state"][k])),
        "keys_equal": set(got) == set(ref["state"]),
        "groups_equal": _groups(optim) == ref["groups"],
        "loss": train_step(model, optim, STEPS),  # type: ignore[arg-type]
    }


def _check(r: dict, ref: dict) -> None:
    assert r["keys_equal"] and r["mismatched"] == [], r["mismatched"][:10]
    assert r["groups_equal"]  # the wrapper's decayed lr came back
    assert r["loss"] == ref["loss"]


def test_optimizer_like_wrapper_saves_and_loads_bit_exact(tmp_path):
    ckpt = str(tmp_path / "c")
    ref = _save(0, 1, "torch", ckpt)
    assert ref["groups"][0]["lr"] == pytest.approx(1e-2 * 0.5**STEPS)
    _check(_load("torch", ckpt, ref), ref)


def test_optimizer_like_async_save_snapshots_at_the_call(tmp_path):
    """Without step hooks everything is copied inside ``save`` (nothing could make step()
    wait); with them the parameters and state are copied in the background and ``step()`` waits.
    Either way the checkpoint holds the values at the call."""
    for wrapper in (ScheduledAdam, HookedScheduledAdam):
        model, optim = _trained("torch", wrapper)
        assert supports_step_hooks(optim) == (wrapper is HookedScheduledAdam)
        at_call = full_state(model, optim)  # type: ignore[arg-type]
        ckpt = str(tmp_path / wrapper.__name__)
        handle = unickpt.save(ckpt, {"model": model, "optimizer": optim}, async_save=True)
        train_step(model, optim, STEPS)  # type: ignore[arg-type]  # changes params and state right away
        handle.wait()
        if isinstance(optim, HookedScheduledAdam):
            assert optim.hook_calls == 1  # unickpt's guard ran before the step
        fresh, inner = build("torch", seed=1234)
        loaded = ScheduledAdam(inner)
        unickpt.load(ckpt, {"model": fresh, "optimizer": loaded})
        got = full_state(fresh, loaded)  # type: ignore[arg-type]
        assert set(got) == set(at_call)
        assert [k for k in at_call if not torch.equal(got[k], at_call[k])] == [], wrapper.__name__


class _ProxyState:
    """Like Megatron's ChainedOptimizer.state: keyed by (index, param), no mapping interface."""

    def __getitem__(self, key: Any) -> Any:
        return None


def test_objects_outside_the_optimizer_contract_are_refused(tmp_path):
    model, inner = build("torch", seed=0)
    chained = type("Chained", (), {"param_groups": inner.param_groups, "state": _ProxyState()})()
    no_params = type("Groups", (), {"param_groups": [{"lr": 1.0}], "state": {}})()
    for bad in (chained, no_params, object()):
        assert not is_optimizer_like(bad)
        with pytest.raises(FrameworkError, match="param_groups.*state") as info:
            unickpt.save(str(tmp_path / "c"), {"model": model, "optimizer": bad})
        assert type(bad).__name__ in str(info.value)
    assert is_optimizer_like(inner) and is_optimizer_like(ScheduledAdam(inner))
