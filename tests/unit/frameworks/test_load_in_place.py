"""A module whose ``state_dict()`` builds new tensors (a state-dict hook: a fused weight split
into parts, as torchtitan's fused attention does) cannot be loaded in place: the values would be
loaded into the hook's copies and dropped. The load is refused before anything is read, and the
module is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unickpt
from unickpt.errors import FrameworkError


class FusedQKV(nn.Module):
    """One fused parameter ``wqkv`` that ``state_dict()`` reports as ``wq`` / ``wk`` / ``wv``."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Parameter(torch.arange(12.0).reshape(6, 2))
        self._register_state_dict_hook(FusedQKV._split)

    @staticmethod
    def _split(module: nn.Module, sd: dict, prefix: str, local_metadata: dict) -> dict:
        fused = sd.pop(prefix + "wqkv")
        for name, part in zip(("wq", "wk", "wv"), fused.chunk(3)):
            sd[prefix + name] = part.clone()  # new tensors, not the parameter
        return sd


def test_a_module_whose_state_dict_builds_new_tensors_is_refused_at_load(tmp_path):
    saved = FusedQKV()
    with torch.no_grad():
        saved.wqkv.mul_(-1)
    unickpt.save(str(tmp_path / "ck"), {"model": saved})  # saving the hook's tensors is fine
    live = FusedQKV()
    before = live.wqkv.detach().clone()
    with pytest.raises(FrameworkError, match=r"'wq'.*not the module's own parameters|not the module's own"):
        unickpt.load(str(tmp_path / "ck"), {"model": live})
    assert torch.equal(live.wqkv, before)


def test_a_plain_module_still_loads_in_place(tmp_path):
    src, dst = nn.Linear(3, 2), nn.Linear(3, 2)
    dst.register_buffer("scale", torch.zeros(2))
    src.register_buffer("scale", torch.full((2,), 7.0))
    unickpt.save(str(tmp_path / "ck"), {"model": src})
    unickpt.load(str(tmp_path / "ck"), {"model": dst})
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.scale, src.scale)
