"""Resume semantics in one process (issue 10 items 2, 6, 7; issue 9 item 13): refused loads
change nothing, optimizer state that never existed stays absent, meta-device models are refused
clearly, hyper-parameters of the wrong type are refused before anything is applied.

The multi-rank cases of the same items are in tests/integration/distributed/test_resume.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from tests.workers.resume_workers import absent_state
from unickpt.errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptMetadataError,
    DtypeMismatchError,
    FrameworkError,
    MissingKeysError,
    ShapeMismatchError,
)
from unickpt.format import METADATA_FILE, decode_metadata


class Tiny(nn.Module):
    def __init__(self, hidden: int = 3, extra: str | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(4, hidden)
        self.b = nn.Linear(hidden, 2)
        if extra:
            self.register_parameter(extra, nn.Parameter(torch.randn(5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def step(model: nn.Module, optim: torch.optim.Optimizer, n: int = 1) -> None:
    for i in range(n):
        first = next(model.parameters())
        model(torch.full((2, 4), float(i + 1), dtype=first.dtype, device=first.device)).square().sum().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's own view of everything a load could change."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": copy.deepcopy(optim.state_dict()),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    model = Tiny()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, optim, 2)
    path = tmp_path / "ckpt"
    unickpt.save(str(path), {"model": model, "optimizer": optim}, framework="torch").wait()
    return path


def edit_metadata(path: Path, change: Callable[[dict], None]) -> None:
    doc = json.loads((path / METADATA_FILE).read_bytes())
    change(doc)
    (path / METADATA_FILE).write_text(json.dumps(doc))


def corrupt_last_shard(path: Path) -> None:
    """Flip one byte of the model shard read last (file order), so earlier shards land first."""
    md = decode_metadata((path / METADATA_FILE).read_bytes())
    _, s = max(
        ((f, s) for f, t in md.tensors.items() for s in t.shards if s.byte_length and f.startswith("model.")),
        key=lambda fs: (fs[1].file_index, fs[1].byte_offset),
    )
    f = path / md.files[s.file_index]
    data = bytearray(f.read_bytes())
    data[s.byte_offset + s.byte_length // 2] ^= 0x10
    f.write_bytes(bytes(data))


def _group0(doc: dict) -> dict:
    return doc["objects"]["optimizer"]["param_groups"][0]


REFUSED: dict[str, tuple[type[CheckpointError], Callable[[Path], None] | None, Callable[[], nn.Module], dict]] = {
    "missing key": (MissingKeysError, None, lambda: Tiny(extra="gate", seed=3), {}),
    "wrong shape": (ShapeMismatchError, None, lambda: Tiny(hidden=5, seed=3), {}),
    "wrong dtype": (DtypeMismatchError, None, lambda: Tiny(seed=3).double(), {}),
    "lr a string": (
        CorruptMetadataError,
        lambda p: edit_metadata(p, lambda d: _group0(d).update(lr="0.1")),
        lambda: Tiny(seed=3),
        {},
    ),
    "corrupt bytes, staged": (
        ChecksumMismatchError,
        corrupt_last_shard,
        lambda: Tiny(seed=3),
        {"options": unickpt.LoadOptions(stage_before_apply=True)},
    ),
}


@pytest.mark.parametrize("trained", [False, True], ids=["fresh optimizer", "trained optimizer"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_item2_refused_load_changes_nothing(ckpt: Path, case: str, trained: bool) -> None:
    """Every refused load leaves model and optimizer bit-identical (a fresh optimizer's state
    stays empty: nothing is materialised before every check passed)."""
    error, damage, build, kw = REFUSED[case]
    if damage is not None:
        damage(ckpt)
    model = build()
    optim = torch.optim.AdamW(model.parameters(), lr=0.3)
    if trained:
        step(model, optim, 3)
    before = snapshot(model, optim)
    with pytest.raises(error):
        unickpt.load(str(ckpt), {"model": model, "optimizer": optim}, framework="torch", **kw)
    assert same(snapshot(model, optim), before)
    if not trained:
        assert len(optim.state) == 0


def test_item2_partial_overwrite_is_said_plainly(ckpt: Path) -> None:
    """Without staging, a checksum failure found after bytes landed says the job's tensors were
    partly overwritten and names the option that prevents it."""
    corrupt_last_shard(ckpt)
    model = Tiny(seed=3)
    with pytest.raises(ChecksumMismatchError) as info:
        unickpt.load(str(ckpt), {"model": model}, framework="torch")
    msg = str(info.value)
    assert "partially overwritten" in msg and "stage_before_apply=True" in msg


def test_item2_stage_before_apply_loads_bit_exact(ckpt: Path) -> None:
    model = Tiny()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, optim, 2)
    want = snapshot(model, optim)
    fresh = Tiny(seed=9)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.7)
    step(fresh, fopt, 1)
    unickpt.load(
        str(ckpt),
        {"model": fresh, "optimizer": fopt},
        framework="torch",
        options=unickpt.LoadOptions(stage_before_apply=True),
    )
    assert same(snapshot(fresh, fopt), want)


# ----------------------------------------------------------------------------- 9.13 hyper-parameter types


def _set(key: str, value: Any) -> Callable[[dict], None]:
    return lambda d: _group0(d).update({key: value})


HYPER = {
    "lr a string": _set("lr", "0.1"),
    "betas of one float": _set("betas", {"__unickpt__": "tuple", "v": [0.9]}),
    "betas of three floats": _set("betas", {"__unickpt__": "tuple", "v": [0.9, 0.99, 0.5]}),
    "betas of strings": _set("betas", {"__unickpt__": "tuple", "v": ["a", "b"]}),
    "amsgrad an int": _set("amsgrad", 1),
    "weight_decay a bool": _set("weight_decay", True),
    "eps None": _set("eps", None),
}


@pytest.mark.parametrize("case", list(HYPER))
def test_item13_hyperparameter_types_validated(ckpt: Path, case: str) -> None:
    """A param-group value whose type does not fit the live optimizer's is refused with a clear
    error naming the group and the key, before anything is applied."""
    edit_metadata(ckpt, HYPER[case])
    model = Tiny(seed=3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.3)
    before = snapshot(model, optim)
    with pytest.raises(CorruptMetadataError) as info:
        unickpt.load(str(ckpt), {"model": model, "optimizer": optim}, framework="torch")
    key = case.split(maxsplit=1)[0]
    assert f"'{key}'" in str(info.value) and "param group 0" in str(info.value)
    assert same(snapshot(model, optim), before) and len(optim.state) == 0


def test_item13_tensor_lr_not_replaced_by_a_list(ckpt: Path) -> None:
    edit_metadata(ckpt, _set("lr", [0.1]))
    model = Tiny(seed=3)
    lr = torch.tensor(0.3)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    with pytest.raises(CorruptMetadataError, match="'lr'"):
        unickpt.load(str(ckpt), {"model": model, "optimizer": optim}, framework="torch")
    assert optim.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.3)


def test_item13_tensor_lr_filled_in_place(ckpt: Path) -> None:
    """A live tensor lr (capturable / fused optimizers) keeps its identity and takes the value."""
    model = Tiny(seed=3)
    lr = torch.tensor(0.3)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    unickpt.load(str(ckpt), {"model": model, "optimizer": optim}, framework="torch")
    assert optim.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.1)
    step(model, optim)


# ----------------------------------------------------------------------------- 6: absent state


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_item6_absent_optimizer_state_stays_absent_torch(tmp_path: Path, kind: str) -> None:
    r = absent_state(0, 1, [("torch", kind)], str(tmp_path))[f"torch-{kind}"]
    assert "step0_error" not in r, r["step0_error"]
    assert r["step0_state_empty"] and r["rollback_state_empty"], r
    assert r["step0_losses"] and r["rollback_losses"] and not r["step0_after"], r
    assert "unused_error" not in r, r["unused_error"]
    assert r["unused_has_no_state"] and not r["unused_loaded"], r
    assert r["unused_next_loss"] and not r["unused_after_next"], r


def test_item6_non_strict_never_invents_state(tmp_path: Path) -> None:
    """strict=False into a model with one more parameter: the checkpoint's parameters get their
    state, the new one none (no step=1 for it)."""
    model = Tiny()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    step(model, optim, 2)
    unickpt.save(str(tmp_path / "c"), {"model": model, "optimizer": optim}, framework="torch").wait()
    bigger = Tiny(extra="gate", seed=4)
    bopt = torch.optim.Adam(bigger.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="gate"):
        unickpt.load(str(tmp_path / "c"), {"model": bigger, "optimizer": bopt}, framework="torch", strict=False)
    assert bigger.gate not in bopt.state
    assert all(float(bopt.state[p]["step"]) == 2.0 for p in (bigger.a.weight, bigger.b.bias))


def test_item6_lbfgs_saves_and_loads(tmp_path: Path) -> None:
    """A closure optimizer (LBFGS) is never stepped by a load: it saves and loads, bit-exact."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 2)

    def train(model: nn.Module, optim: torch.optim.Optimizer) -> float:
        def closure() -> torch.Tensor:
            optim.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        return float(optim.step(closure).detach())

    model = Tiny()
    optim = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=3, max_iter=4)
    train(model, optim)
    unickpt.save(str(tmp_path / "c"), {"model": model, "optimizer": optim}, framework="torch").wait()
    want = snapshot(model, optim)
    nxt = train(model, optim)
    for trained in (False, True):
        fresh = Tiny(seed=5)
        fopt = torch.optim.LBFGS(fresh.parameters(), lr=0.5, history_size=3, max_iter=4)
        if trained:
            train(fresh, fopt)
        unickpt.load(str(tmp_path / "c"), {"model": fresh, "optimizer": fopt}, framework="torch")
        assert same(snapshot(fresh, fopt), want)
        assert train(fresh, fopt) == nxt


# ----------------------------------------------------------------------------- 7: meta device


def test_item7_meta_device_model_refused(tmp_path: Path, ckpt: Path) -> None:
    with torch.device("meta"):
        model = Tiny()
    with pytest.raises(FrameworkError) as info:
        unickpt.save(str(tmp_path / "m"), {"model": model}, framework="torch")
    msg = str(info.value)
    assert "model.a.weight" in msg and "meta" in msg and "to_empty" in msg
    with pytest.raises(FrameworkError) as info:
        unickpt.load(str(ckpt), {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}, framework="torch")
    msg = str(info.value)
    assert "model.a.weight" in msg and "meta" in msg and "to_empty" in msg
    model.to_empty(device="cpu")  # the advice works
    unickpt.load(str(ckpt), {"model": model}, framework="torch")


# ----------------------------------------------------------------------------- old objects, devices


def test_item5_reads_the_older_optimizer_object_layout(tmp_path: Path) -> None:
    """Checkpoints written before groups were merged per parameter hold rank 0's groups as they
    were (here: two groups with the same hyper-parameters); they load strictly, and a layout
    that lacks a live parameter's group is named under strict and skipped otherwise."""
    model = Tiny()
    optim = torch.optim.AdamW([{"params": model.a.parameters()}, {"params": model.b.parameters()}], lr=0.05)
    step(model, optim, 2)
    unickpt.save(str(tmp_path / "c"), {"model": model, "optimizer": optim}, framework="torch").wait()
    want = snapshot(model, optim)

    def legacy(doc: dict) -> None:
        (merged,) = doc["objects"]["optimizer"]["param_groups"]
        hyper = {k: v for k, v in merged.items() if k != "params"}
        doc["objects"]["optimizer"]["param_groups"] = [
            {**hyper, "params": ["a.weight", "a.bias"]},
            {**hyper, "params": ["b.weight", "b.bias"]},
        ]

    edit_metadata(tmp_path / "c", legacy)
    fresh = Tiny(seed=2)
    fopt = torch.optim.AdamW([{"params": fresh.a.parameters()}, {"params": fresh.b.parameters()}], lr=0.9)
    unickpt.load(str(tmp_path / "c"), {"model": fresh, "optimizer": fopt}, framework="torch")
    assert same(snapshot(fresh, fopt), want)

    edit_metadata(tmp_path / "c", lambda d: d["objects"]["optimizer"]["param_groups"].pop())  # rank 0's only
    fresh = Tiny(seed=2)
    fopt = torch.optim.AdamW([{"params": fresh.a.parameters()}, {"params": fresh.b.parameters(), "lr": 0.9}])
    with pytest.raises(MissingKeysError, match="optimizer.param_groups.b.weight"):
        unickpt.load(str(tmp_path / "c"), {"model": fresh, "optimizer": fopt}, framework="torch")
    assert len(fopt.state) == 0
    with pytest.warns(UserWarning, match="optimizer.param_groups.b.weight"):
        unickpt.load(str(tmp_path / "c"), {"model": fresh, "optimizer": fopt}, framework="torch", strict=False)
    assert same(snapshot(fresh, fopt)["optim"]["state"], want["optim"]["state"])
    assert fopt.param_groups[1]["lr"] == 0.9  # no saved group: the live one is kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("flag", ["fused", "capturable"])
def test_item1_fresh_state_on_the_parameters_device(tmp_path: Path, flag: str) -> None:
    """Fused / capturable Adam keeps ``step`` on the parameter's device: a fresh optimizer loaded
    from a checkpoint gets it there too, and its next step equals the uninterrupted one."""
    model = Tiny().cuda()
    optim = torch.optim.Adam(model.parameters(), lr=0.1, **{flag: True})
    step(model, optim, 2)
    unickpt.save(str(tmp_path / "c"), {"model": model, "optimizer": optim}, framework="torch").wait()
    step(model, optim)
    want = snapshot(model, optim)
    fresh = Tiny(seed=4).cuda()
    fopt = torch.optim.Adam(fresh.parameters(), lr=0.1, **{flag: True})
    unickpt.load(str(tmp_path / "c"), {"model": fresh, "optimizer": fopt}, framework="torch")
    assert all(s["step"].device.type == "cuda" for s in fopt.state.values())
    step(fresh, fopt)
    assert same(snapshot(fresh, fopt), want)


def test_item13_another_optimizer_class_refused_under_strict(ckpt: Path) -> None:
    """An AdamW checkpoint into SGD: its hyper-parameters and state would break SGD.step();
    refused under strict before anything changes (strict=False loads it, as torch would)."""
    model = Tiny(seed=3)
    optim = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    before = snapshot(model, optim)
    with pytest.raises(FrameworkError, match="another optimizer class") as info:
        unickpt.load(str(ckpt), {"model": model, "optimizer": optim}, framework="torch")
    assert "momentum" in str(info.value) and "betas" in str(info.value)
    assert same(snapshot(model, optim), before)
