"""The key-mapping hook on load and ``unickpt modify`` (issue 15): a checkpoint loads into a
model whose names differ, model and optimizer; modify renames / drops / casts into a new
checkpoint and never touches the source. Expected values come from torch's own state dicts.

Its tests that start processes are in ``tests/integration/tools/test_tools_keymap_processes.py``."""

from __future__ import annotations

import torch
from torch import nn

import unickpt
from tests.support.compare import same_tensor
from unickpt.options import RestoreOptions


class Old(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 6)
        self.head = nn.Linear(6, 2)


class New(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 6)
        self.out = nn.Linear(6, 2)


def _trained(cls, seed: int):
    torch.manual_seed(seed)
    m = cls()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
    first = m.enc if cls is Old else m.encoder
    last = m.head if cls is Old else m.out
    last(first(torch.randn(3, 4))).sum().backward()
    opt.step()
    return m, opt


def _rename(key: str) -> str:
    return key.replace(".enc.", ".encoder.").replace(".head.", ".out.")


def _same_training_state(a: nn.Module, oa, b: nn.Module, ob) -> bool:
    """The same parameter values in order (the names differ) and optimizer state, the same lr."""
    sa, sb = a.state_dict(), b.state_dict()
    if len(sa) != len(sb) or not all(same_tensor(x, y) for x, y in zip(sa.values(), sb.values())):
        return False
    for pa, pb in zip(a.parameters(), b.parameters()):
        if any(not same_tensor(oa.state[pa][k], ob.state[pb][k]) for k in oa.state[pa]):
            return False
    return oa.param_groups[0]["lr"] == ob.param_groups[0]["lr"]


def test_issue15_key_map_loads_into_renamed_model_and_optimizer(tmp_path):
    old, old_opt = _trained(Old, 0)
    unickpt.save(str(tmp_path / "ck"), {"model": old, "optimizer": old_opt})
    new, new_opt = _trained(New, 1)
    options = unickpt.LoadOptions(restore=RestoreOptions(key_map=_rename))
    unickpt.load(str(tmp_path / "ck"), {"model": new, "optimizer": new_opt}, strict=True, options=options)
    assert _same_training_state(old, old_opt, new, new_opt)
