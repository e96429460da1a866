"""Issue 39, items 5-9, one process: a ``Stateful``'s state comes back exactly (user dicts shaped
like unickpt's own placeholders, conjugate and negative views, parameters and ``requires_grad``),
a state with shared sub-structures is refused at once with its size, and a list of Statefuls
under one key saves and loads like a single one. The multi-rank case of lists is
``tests/integration/distributed/test_stateful_lists_processes.py``."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from unickpt.errors import FrameworkError, SizeLimitError, StatefulListMismatchError, UnsupportedValueError


class Holder:
    """A user Stateful whose state_dict() is the dict it was given (loaded: what it received)."""

    def __init__(self, sd: Any) -> None:
        self.sd, self.loaded = sd, None

    def state_dict(self) -> Any:
        return self.sd

    def load_state_dict(self, sd: Any) -> None:
        self.loaded = sd


def _metadata(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "unickpt.metadata.json")) as f:
        return json.load(f)


def test_issue39_item5_user_dicts_shaped_like_placeholders_round_trip(tmp_path):
    t = torch.arange(3.0)
    sd = {
        "t": t,
        "cfg": {"__unickpt_tensor__": "train.t"},  # names a saved tensor
        "nothing": {"__unickpt_tensor__": "nothing"},  # names none
        "more": {"__unickpt_tensor__": 1, "other": [2]},
        "escape": {"__unickpt_dict__": {"__unickpt_tensor__": "train.t"}},
        "nested": [{"__unickpt_dict__": 5}, ({"__unickpt_tensor__": "x"},)],
        "int_keys": {1: {"__unickpt_tensor__": "train.t"}},
    }
    path = str(tmp_path / "c")
    unickpt.save(path, {"train": Holder(sd)})
    got = Holder(None)
    unickpt.load(path, {"train": got})
    want = {k: v for k, v in sd.items() if k != "t"}
    assert {k: v for k, v in got.loaded.items() if k != "t"} == want
    assert torch.equal(got.loaded["t"], t)
    # per rank (the blob holds the state as it is): the same dicts come back too
    unickpt.save(path + "p", {"train": unickpt.PerRank(Holder(sd))})
    got = Holder(None)
    unickpt.load(path + "p", {"train": unickpt.PerRank(got)})
    assert {k: v for k, v in got.loaded.items() if k != "t"} == want


def test_issue39_item5_checkpoints_of_older_releases_join_as_written(tmp_path):
    path = str(tmp_path / "c")
    unickpt.save(path, {"train": Holder({"t": torch.arange(3.0), "d": {"__unickpt_dict__": {"a": 1}}})})
    md = _metadata(path)
    assert md["objects"]["state_encoding"] == {"escaped_dicts": 1}
    del md["objects"]["state_encoding"]  # as a release before the escapes wrote it
    with open(os.path.join(path, "unickpt.metadata.json"), "w") as f:
        json.dump(md, f)
    got = Holder(None)
    unickpt.load(path, {"train": got})
    assert torch.equal(got.loaded["t"], torch.arange(3.0))  # placeholders still read as tensors
    assert got.loaded["d"] == {"__unickpt_dict__": {"__unickpt_dict__": {"a": 1}}}  # nothing unwrapped


def test_issue39_item6_conjugate_and_negative_views_save_as_their_values(tmp_path):
    z = torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64)
    conj, neg = z.conj(), z.conj().imag  # a conjugate view; a negative-bit view of float32
    assert conj.is_conj() and neg.is_neg()
    one = torch.tensor([1 + 1j]).conj().imag  # one element, stride 2: "contiguous", yet not viewable as bytes
    path = str(tmp_path / "c")
    unickpt.save(path, {"s": Holder({"conj": conj, "neg": neg, "plain": z, "one": one})})
    got = Holder(None)
    unickpt.load(path, {"s": got})
    assert torch.equal(got.loaded["conj"], torch.tensor([1 - 2j, -3 + 4j], dtype=torch.complex64))
    assert torch.equal(got.loaded["neg"], torch.tensor([-2.0, 4.0]))
    assert torch.equal(got.loaded["plain"], z) and torch.equal(got.loaded["one"], torch.tensor([-1.0]))
    assert not got.loaded["conj"].is_conj() and not got.loaded["neg"].is_neg()
    # the same tensors as plain values (extra_state) come back as their values too
    unickpt.save(path + "v", {"extra_state": {"conj": conj, "neg": neg, "one": one}})
    state: dict[str, Any] = {"extra_state": None}
    unickpt.load(path + "v", state)
    assert torch.equal(state["extra_state"]["one"], torch.tensor([-1.0]))
    assert torch.equal(state["extra_state"]["neg"], torch.tensor([-2.0, 4.0]))


def _shared(levels: int) -> list[Any]:
    d: list[Any] = []
    for _ in range(levels):
        d = [d, d]  # 1 list of 2 references to the one below: 2^(levels+1) - 1 lists written out
    return d


@pytest.mark.timeout(60)  # a walk of every reference (2^41 lists) would never end
def test_issue39_item7_shared_sub_structures_are_refused_with_their_size(tmp_path):
    lists = 2 ** (40 + 1) - 1  # the lists of _shared(40) with every reference written out
    cases = [({"s": Holder({"d": _shared(40), "t": torch.ones(2)})}, lists + 2), ({"extra_state": _shared(40)}, lists)]
    for state, expanded in cases:  # + the state_dict's dict and its tensor
        path = str(tmp_path / "c")
        with pytest.raises(SizeLimitError, match=f"expands to {expanded} values") as caught:
            unickpt.save(path, state)
        assert ("state['s'].state_dict()" if "s" in state else "extra_state") in str(caught.value)
        assert not os.path.exists(path) or not os.listdir(path)
    looped: list[Any] = []
    looped.append(looped)
    with pytest.raises(UnsupportedValueError, match=r"state\['s'\]\.state_dict\(\).*contains itself"):
        unickpt.save(str(tmp_path / "l"), {"s": Holder({"loop": looped})})
    # sharing below the cap is written out once per reference and comes back as a tree
    path = str(tmp_path / "ok")
    unickpt.save(path, {"s": Holder({"d": _shared(10)})})
    got = Holder(None)
    unickpt.load(path, {"s": got})
    assert got.loaded["d"] == _shared(10)


class Learnable:
    """A user Stateful with a learnable scale (a Parameter) and a bias that requires grad."""

    def __init__(self, scale_len: int = 3) -> None:
        self.scale = nn.Parameter(torch.ones(scale_len))
        self.bias = torch.zeros(2, requires_grad=True)
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "bias": self.bias, "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale, self.bias, self.step = sd["scale"], sd["bias"], sd["step"]


def _trained() -> Learnable:
    s = Learnable()
    with torch.no_grad():
        s.scale.copy_(torch.tensor([1.5, 2.5, 3.5]))
        s.bias.copy_(torch.tensor([-1.0, 4.0]))
    s.step = 7
    return s


def test_issue39_item8_parameters_and_requires_grad_load_in_place(tmp_path):
    path = str(tmp_path / "c")
    saved = _trained()
    unickpt.save(path, {"learn": saved})
    for target in (Learnable(), saved):  # a fresh object, and the live one after more steps
        if target is saved:
            with torch.no_grad():
                saved.scale.mul_(0)
                saved.bias.add_(9)
        scale, bias = target.scale, target.bias
        opt = torch.optim.SGD([target.scale, target.bias], lr=0.1)
        unickpt.load(path, {"learn": target})
        assert target.scale is scale and target.bias is bias  # the optimizer still holds them
        assert opt.param_groups[0]["params"][0] is target.scale
        assert type(target.scale) is nn.Parameter and target.scale.requires_grad
        assert type(target.bias) is torch.Tensor and target.bias.requires_grad and target.bias.is_leaf
        assert torch.equal(target.scale.detach(), torch.tensor([1.5, 2.5, 3.5]))
        assert torch.equal(target.bias.detach(), torch.tensor([-1.0, 4.0])) and target.step == 7
        (target.scale.sum() + target.bias.sum()).backward()  # and they still train
        opt.step()
        assert torch.equal(target.scale.detach(), torch.tensor([1.4, 2.4, 3.4]))


def test_issue39_item8_a_tensor_that_cannot_load_in_place_keeps_its_type(tmp_path):
    path = str(tmp_path / "c")
    unickpt.save(path, {"learn": _trained()})
    other = Learnable(scale_len=5)  # another shape: a fresh tensor of the saved one, typed as the live one
    other.bias = other.bias.detach().double().requires_grad_()  # another dtype
    unickpt.load(path, {"learn": other})
    assert type(other.scale) is nn.Parameter and other.scale.requires_grad
    assert torch.equal(other.scale.detach(), torch.tensor([1.5, 2.5, 3.5]))
    assert other.bias.requires_grad and other.bias.dtype == torch.float32 and other.bias.is_leaf


def _loop(seed: int = 0) -> dict[str, Any]:
    """Two modules, an optimizer and an LR scheduler for each (schedulers of two kinds)."""
    torch.manual_seed(seed)
    parts = [nn.Linear(3, 3), nn.Linear(3, 2)]
    optims = [torch.optim.SGD(parts[0].parameters(), lr=0.5), torch.optim.AdamW(parts[1].parameters(), lr=0.1)]
    scheds = [
        torch.optim.lr_scheduler.StepLR(optims[0], step_size=2, gamma=0.5),
        torch.optim.lr_scheduler.CosineAnnealingLR(optims[1], T_max=10),
    ]
    return {"model": parts[0], "head": parts[1], "optimizer": optims, "lr_scheduler": scheds}


def _params(state: dict[str, Any]) -> list[torch.Tensor]:
    return [*state["model"].parameters(), *state["head"].parameters()]


def _steps(state: dict[str, Any], n: int) -> None:
    for _ in range(n):
        x = state["head"](state["model"](torch.ones(2, 3)))
        x.sum().backward()
        for o, s in zip(state["optimizer"], state["lr_scheduler"]):
            o.step()
            o.zero_grad()
            s.step()


def test_issue39_item9_a_list_of_lr_schedulers_under_one_key_round_trips(tmp_path):
    state = _loop()
    _steps(state, 3)
    state["extras"] = (_trained(), Holder({"n": 4, "t": torch.arange(2)}))  # a tuple, tensors inside
    path = str(tmp_path / "c")
    unickpt.save(path, state)
    md = _metadata(path)
    assert md["objects"]["state_keys"]["lr_scheduler"] == "stateful_list"
    assert md["objects"]["state_encoding"]["lists"] == {"extras": 2, "lr_scheduler": 2}
    assert "lr_scheduler/replicated" in md["blobs"] and {"extras.0.scale", "extras.1.t"} <= set(md["tensors"])
    fresh = _loop(seed=1)
    fresh["extras"] = (Learnable(), Holder(None))
    scale = fresh["extras"][0].scale
    unickpt.load(path, fresh)
    for s, want in zip(fresh["lr_scheduler"], state["lr_scheduler"]):
        assert type(s) is type(want) and s.last_epoch == want.last_epoch == 3
        assert s.get_last_lr() == want.get_last_lr()
    lrs = [[o.param_groups[0]["lr"] for o in s["optimizer"]] for s in (fresh, state)]
    assert lrs[0] == lrs[1]
    assert fresh["extras"][0].scale is scale and torch.equal(scale.detach(), torch.tensor([1.5, 2.5, 3.5]))
    assert fresh["extras"][1].loaded["n"] == 4 and torch.equal(fresh["extras"][1].loaded["t"], torch.arange(2))
    _steps(fresh, 2)  # the resumed run goes on as the saved one does
    _steps(state, 2)
    assert [s.get_last_lr() for s in fresh["lr_scheduler"]] == [s.get_last_lr() for s in state["lr_scheduler"]]
    assert all(torch.equal(p, q) for p, q in zip(_params(fresh), _params(state)))


def test_issue39_item9_another_list_length_is_refused_naming_the_key(tmp_path):
    state = _loop()
    _steps(state, 3)
    path = str(tmp_path / "c")
    unickpt.save(path, state)
    for n in (1, 3):
        live = _loop(seed=1)
        opt = live["optimizer"][0]
        live["lr_scheduler"] = [torch.optim.lr_scheduler.StepLR(opt, step_size=2) for _ in range(n)]
        before = [p.detach().clone() for p in _params(live)]
        with pytest.raises(StatefulListMismatchError, match=rf"list of 2 .*state\['lr_scheduler'\].* list of {n}"):
            unickpt.load(path, live)
        assert all(torch.equal(a, p) for a, p in zip(before, _params(live)))  # refused before any read
    live = _loop(seed=1)
    live["lr_scheduler"] = live["lr_scheduler"][0]  # one object where a list was saved
    with pytest.raises(StatefulListMismatchError, match=r"list of 2 .*state\['lr_scheduler'\] and this job one"):
        unickpt.load(path, live)
    single = _loop()
    single["lr_scheduler"] = single["lr_scheduler"][0]
    unickpt.save(path + "1", single)
    with pytest.raises(StatefulListMismatchError, match=r"one Stateful object under state\['lr_scheduler'\]"):
        unickpt.load(path + "1", _loop(seed=1))
    mixed = _loop()
    mixed["lr_scheduler"] = [mixed["lr_scheduler"][0], mixed["optimizer"][0]]
    with pytest.raises(FrameworkError, match=r"state\['lr_scheduler'\]\[1\] is a SGD"):
        unickpt.save(path + "m", mixed)
    assert not os.path.exists(path + "m")
