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
from unickpt.errors import SizeLimitError, UnsupportedValueError


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
    path = str(tmp_path / "c")
    unickpt.save(path, {"s": Holder({"conj": conj, "neg": neg, "plain": z})})
    got = Holder(None)
    unickpt.load(path, {"s": got})
    assert torch.equal(got.loaded["conj"], torch.tensor([1 - 2j, -3 + 4j], dtype=torch.complex64))
    assert torch.equal(got.loaded["neg"], torch.tensor([-2.0, 4.0]))
    assert torch.equal(got.loaded["plain"], z)
    assert not got.loaded["conj"].is_conj() and not got.loaded["neg"].is_neg()


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
