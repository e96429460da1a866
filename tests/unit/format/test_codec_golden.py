"""Golden checkpoints of format version 1 (tests/fixtures/golden/, written once by
``make_golden_v1.py`` with the unickpt that introduced version 1): every later unickpt must
still load them bit-exact.

The expected values are computed here from the same closed formula the generator used, never
read back through unickpt.

Its tests that start processes are in ``tests/integration/format/test_golden_processes.py``.
"""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch
from torch import nn

import unickpt
from tests.fixtures.golden_v1 import GOLDEN, expected_fsdp2_ws3, formula
from tests.support.compare import same_bits


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 4, bias=False)
        self.b.to(torch.bfloat16)
        self.register_buffer("counts", torch.zeros(5, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).to(torch.bfloat16)).float()


def _collect(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full tensors by canonical key, with torch's own APIs (``full_tensor`` for DTensors)."""

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{n}": full(t) for n, t in model.state_dict().items()}
    for p, st in optim.state.items():
        for k, v in st.items():
            out[f"optimizer.state.{names[id(p)]}.{k}"] = full(v)
    return out


def _check_state(got: dict[str, torch.Tensor], optim: torch.optim.Optimizer) -> None:
    want = expected_fsdp2_ws3()
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not same_bits(got[k], want[k])]
    assert not bad, bad
    (group,) = optim.param_groups
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.125, (0.5, 0.75), 0.0625)


def _check_extra(extra: dict, rank: int) -> None:
    assert {k: extra[k] for k in ("step", "rank", "name", "ratio", "big")} == {
        "step": 7,
        "rank": rank,
        "name": "golden",
        "ratio": 0.375,
        "big": 2**70,
    }
    assert math.isnan(extra["nan"])
    assert extra["tuple"] == (1, "two", None) and isinstance(extra["tuple"], tuple)
    assert extra["bytes"] == b"\x00\x01golden"
    assert extra["list"] == [1, [2, [3]]]
    assert extra["ints"] == {1: "one", 2: "two"}
    assert torch.equal(extra["tensor"], torch.arange(6, dtype=torch.int32).reshape(2, 3) + rank)
    assert extra["tensor"].dtype == torch.int32
    np.testing.assert_array_equal(extra["array"], np.arange(4, dtype=np.float64) / 8 + rank)
    assert extra["array"].dtype == np.float64


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(123)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.9, 0.9), weight_decay=0.0)
    return model, optim


def _golden_copy(tmp_path, name: str) -> str:
    """A private copy: loads must work read-only, but a copy keeps the fixture pristine anyway."""
    dst = tmp_path / name
    shutil.copytree(os.path.join(GOLDEN, name), dst)
    return str(dst)


def test_golden_v1_fsdp2_ws3_loads_into_one_process_bit_exact(tmp_path):
    ckpt = _golden_copy(tmp_path, "v1_fsdp2_ws3")
    model, optim = _fresh()
    state = {"model": model, "optimizer": optim, "extra_state": None}
    unickpt.load(ckpt, state, framework="torch")
    _check_state(_collect(model, optim), optim)
    _check_extra(state["extra_state"], rank=0)


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Parameter(torch.zeros(70, 3))
        self.register_buffer("scalar", torch.zeros((), dtype=torch.float64))
        self.register_buffer("empty", torch.zeros(0, 4))


def test_golden_v1_binary_shard_table_loads_bit_exact(tmp_path):
    ckpt = _golden_copy(tmp_path, "v1_table")
    model = Table()
    unickpt.load(ckpt, {"model": model}, framework="torch")
    assert same_bits(model.rows.detach(), formula("model.rows", (70, 3), torch.float32))
    assert same_bits(model.scalar, formula("model.scalar", (), torch.float64))
    assert model.empty.shape == (0, 4)


@pytest.mark.parametrize("name", ["v1_fsdp2_ws3", "v1_table"])
def test_golden_v1_verifies_with_inspect(tmp_path, name):
    from unickpt.cli import main

    assert main(["inspect", "--verify", _golden_copy(tmp_path, name)]) == 0
