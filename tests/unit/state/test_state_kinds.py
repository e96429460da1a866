"""Issue 27, one process: what can be in ``state`` (any key, model parts, several optimizers,
wrapper optimizers, Stateful objects, per-rank state), strict per key, and the refusals that
happen before anything is written. The multi-rank case is ``tests/distributed/test_open_state``."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from unickpt.errors import FrameworkError, MissingKeysError, UnexpectedKeysError, UnsupportedValueError


def _metadata(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "unickpt.metadata.json")) as f:
        return json.load(f)


def _nothing_written(path: str) -> bool:
    return not os.path.exists(path) or not os.listdir(path)


class Part(nn.Module):
    def __init__(self, numbers: range) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(3, 3) for i in numbers})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _train(model: list[nn.Module] | nn.Module, optims: list[Any]) -> None:
    x = torch.ones(2, 3)
    for part in model if isinstance(model, list) else [model]:
        x = part(x)
    x.sum().backward()
    for o in optims:
        o.step()
        o.zero_grad()


class Counter:
    """A user Stateful: plain values of several types and a tensor."""

    def __init__(self, n: int = 0) -> None:
        self.n, self.t = n, torch.arange(4, dtype=torch.int16) * n
        self.shape = (n, "x")

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "t": self.t, "shape": self.shape, "ratio": self.n / 3, "scalar": torch.tensor(self.n)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n, self.t, self.shape, self.ratio = sd["n"], sd["t"], sd["shape"], sd["ratio"]
        self.scalar = sd["scalar"]


def test_one_module_with_two_groups_loads_into_two_parts_with_two_optimizers(tmp_path):
    torch.manual_seed(0)
    whole = Part(range(4))
    named = dict(whole.named_parameters())
    first = [p for n, p in named.items() if n.split(".")[1] in "01"]
    rest = [p for n, p in named.items() if n.split(".")[1] in "23"]
    opt = torch.optim.AdamW([{"params": first, "lr": 0.1}, {"params": rest, "lr": 0.02}])
    _train(whole, [opt])
    path = str(tmp_path / "c")
    unickpt.save(path, {"model": whole, "optimizer": opt})
    parts = [Part(range(0, 2)), Part(range(2, 4))]
    optims = [torch.optim.AdamW(p.parameters(), lr=5.0) for p in parts]
    unickpt.load(path, {"model": parts, "optimizer": optims})
    assert [o.param_groups[0]["lr"] for o in optims] == [0.1, 0.02]
    loaded = {n: p for part in parts for n, p in part.named_parameters()}
    for n, p in named.items():
        assert torch.equal(loaded[n], p)
        for k, v in opt.state[p].items():
            assert torch.equal(optims[0 if any(p is q for q in first) else 1].state[loaded[n]][k], v)


def test_module_under_another_key_is_saved_under_that_key(tmp_path):
    model, ema = nn.Linear(2, 2), nn.Linear(2, 2)
    path = str(tmp_path / "c")
    unickpt.save(path, {"model": model, "ema": ema})
    md = _metadata(path)
    assert {"model.weight", "model.bias", "ema.weight", "ema.bias"} <= set(md["tensors"])
    fresh = nn.Linear(2, 2)
    unickpt.load(path, {"model": nn.Linear(2, 2), "ema": fresh})
    assert torch.equal(fresh.weight, ema.weight) and torch.equal(fresh.bias, ema.bias)


def test_stateful_objects_round_trip_with_their_types(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(3):
        opt.step()
        sched.step()
    path = str(tmp_path / "c")
    unickpt.save(path, {"model": model, "optimizer": opt, "sched": sched, "scaler": scaler, "user": Counter(7)})
    assert {"sched/replicated", "scaler/replicated", "user/replicated"} <= set(_metadata(path)["blobs"])
    model2 = nn.Linear(2, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    scaler2, user = torch.amp.GradScaler("cpu", init_scale=2.0), Counter()
    unickpt.load(path, {"model": model2, "optimizer": opt2, "sched": sched2, "scaler": scaler2, "user": user})
    assert sched2.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr() == [0.25]
    assert opt2.param_groups[0]["lr"] == 0.25
    assert scaler2.get_scale() == 1024.0
    assert user.n == 7 and type(user.n) is int and user.shape == (7, "x") and user.ratio == 7 / 3
    assert user.t.dtype == torch.int16 and torch.equal(user.t, torch.arange(4, dtype=torch.int16) * 7)
    assert user.scalar.shape == () and int(user.scalar) == 7


def test_per_rank_state_is_saved_per_rank(tmp_path):
    path = str(tmp_path / "c")
    unickpt.save(path, {"model": nn.Linear(2, 2), "gen": unickpt.PerRank(Counter(3))})
    assert "gen/rank0" in _metadata(path)["blobs"]
    got = Counter()
    unickpt.load(path, {"model": nn.Linear(2, 2), "gen": unickpt.PerRank(got)})
    assert got.n == 3 and torch.equal(got.t, Counter(3).t)
    unickpt.save(path + "r", {"model": nn.Linear(2, 2), "gen": Counter(5)})  # saved replicated, tensors apart
    got = Counter()
    unickpt.load(path + "r", {"model": nn.Linear(2, 2), "gen": unickpt.PerRank(got)})
    assert got.n == 5 and torch.equal(got.t, Counter(5).t) and int(got.scalar) == 5
    with pytest.raises(FrameworkError, match="state_dict"):
        unickpt.PerRank(object())


class Container(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer: a torch Optimizer over every parameter whose own state
    stays empty; the state lives in ``optimizers``."""

    def __init__(self, models: list[nn.Module]) -> None:
        self.optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01 * (i + 1)) for i, m in enumerate(models)]
        super().__init__([p for m in models for p in m.parameters()], {"lr": 0.0})

    def step(self, closure: Any = None) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad()


class Hiding(torch.optim.Optimizer):
    """A wrapper with parameters and an empty state that keeps its inner optimizer in an
    attribute without delegating: refused, never saved empty."""

    def __init__(self, model: nn.Module) -> None:
        self.inner = torch.optim.AdamW(model.parameters())
        super().__init__(list(model.parameters()), {"lr": 0.0})


def test_wrapper_optimizer_is_unwrapped_and_a_hiding_one_refused(tmp_path):
    parts = [Part(range(0, 1)), Part(range(1, 2))]
    container = Container(parts)
    _train(parts, [container])
    assert len(container.state) == 0
    path = str(tmp_path / "c")
    unickpt.save(path, {"model": parts, "optimizer": container})
    assert any(k.startswith("optimizer.state.layers.1.weight.exp_avg") for k in _metadata(path)["tensors"])
    parts2 = [Part(range(0, 1)), Part(range(1, 2))]
    container2 = Container(parts2)
    unickpt.load(path, {"model": parts2, "optimizer": container2})
    p, p2 = parts[1].layers["1"].weight, parts2[1].layers["1"].weight
    assert torch.equal(container2.optimizers[1].state[p2]["exp_avg"], container.optimizers[1].state[p]["exp_avg"])

    model = nn.Linear(2, 2)
    hiding = Hiding(model)
    with pytest.raises(FrameworkError, match=r"state\['optimizer'\].*wraps another optimizer in \.inner"):
        unickpt.save(str(tmp_path / "h"), {"model": model, "optimizer": hiding})
    assert _nothing_written(str(tmp_path / "h"))


@pytest.mark.parametrize(
    "case",
    ["two_parts_one_name", "optimizer_outside_the_modules", "unsupported_stateful_value", "invalid_key", "nested_keys"],
)
def test_refused_before_anything_is_written(tmp_path, case):
    model = nn.Linear(2, 2)
    if case == "two_parts_one_name":
        state: dict[str, Any] = {"model": [nn.Linear(2, 2), nn.Linear(2, 2)]}
        match = "two model parts .* both name 'weight'"
    elif case == "optimizer_outside_the_modules":
        state = {"model": model, "optimizer": torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(1))])}
        match = "no module in the state owns it"
    elif case == "unsupported_stateful_value":

        class Bad(Counter):
            def state_dict(self) -> dict[str, Any]:
                return {"n": 1, "fn": object()}

        state = {"model": model, "bad": Bad()}
        match = r"state\['bad'\]\.state_dict\(\)"
    elif case == "nested_keys":  # model.ema.* would be among model.*
        state, match = {"model": model, "model.ema": nn.Linear(2, 2)}, "'model' and 'model.ema'"
    else:
        state, match = {"model": model, "no spaces": 1}, "invalid state key 'no spaces'"
    path = str(tmp_path / "c")
    with pytest.raises((FrameworkError, UnsupportedValueError), match=match):
        unickpt.save(path, state)
    assert _nothing_written(path)


def test_strict_per_key(tmp_path):
    path = str(tmp_path / "c")
    unickpt.save(path, {"model": nn.Linear(2, 2), "ema": nn.Linear(2, 2), "user": Counter(4), "step": 9})
    with pytest.raises(MissingKeysError, match="sched"):
        unickpt.load(path, {"model": nn.Linear(2, 2), "ema": nn.Linear(2, 2), "user": Counter(), "step": None,
                            "sched": Counter()})  # fmt: skip
    with pytest.raises(UnexpectedKeysError, match="ema.*step.*user"):
        unickpt.load(path, {"model": nn.Linear(2, 2)})
    user, state = Counter(), {"model": nn.Linear(2, 2), "user": Counter(), "sched": Counter()}
    state["user"] = user
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unickpt.load(path, state, strict=False)  # the intersection
    text = " ".join(str(w.message) for w in caught)
    assert "sched" in text and "ema" in text and "step" in text
    assert user.n == 4 and state["sched"].n == 0
    # a state may load the weights alone (as every release allowed): model/optimizer/extra_state optional
    unickpt.save(path + "2", {"model": nn.Linear(2, 2), "extra_state": {"a": 1}})
    unickpt.load(path + "2", {"model": nn.Linear(2, 2)})


def test_state_keys_object_is_the_union_of_the_ranks():
    from unickpt.errors import PlanningError
    from unickpt.planning.objects import merge_rank_objects

    ranks = [{"state_keys": {"model": "module", "dataloader": "dataloader"}}, {"state_keys": {"model": "module"}}]
    assert merge_rank_objects(ranks)["state_keys"] == {"dataloader": "dataloader", "model": "module"}
    with pytest.raises(PlanningError, match=r"state\['x'\] is a value on rank 0 and a stateful on rank 1"):
        merge_rank_objects([{"state_keys": {"x": "value"}}, {"state_keys": {"x": "stateful"}}])
