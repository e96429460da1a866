"""Issue 39 item 20: a renamed layer's load error points to ``key_map`` first (with the rename
it can see), and says what ``strict=False`` would leave behind."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unickpt
from unickpt.options import RestoreOptions
from unickpt.planning.load.targets import keys_error, rename_guess


class _Net(nn.Module):
    def __init__(self, block: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        setattr(self, block, nn.Linear(3, 3))
        self.head = nn.Linear(3, 1)


def test_issue39_item20_rename_guess_finds_the_substitution() -> None:
    missing = ["model.layers.0.attn.weight", "model.layers.1.attn.weight", "model.new_head.bias"]
    unexpected = ["model.layers.0.attention.weight", "model.layers.1.attention.weight", "model.old.bias"]
    assert rename_guess(missing, unexpected) == (".attention.", ".attn.")
    assert rename_guess(["model.a"], ["other.b"]) is None  # nothing in common: no guess
    assert rename_guess(["x.w"], ["y.z"]) is None


def test_issue39_item20_only_missing_keys_keep_the_strict_hint() -> None:
    msg = str(keys_error(["model.extra.weight"], [], "ck"))
    assert "key_map" not in msg and "strict=False" in msg and "initial values" in msg


def test_issue39_item20_renamed_layer_error_points_to_key_map(tmp_path) -> None:
    saved = _Net("attention")
    opt = torch.optim.Adam(saved.parameters())
    saved.head(saved.attention(torch.ones(1, 3))).sum().backward()
    opt.step()
    unickpt.save(str(tmp_path / "ck"), {"model": saved, "optimizer": opt})

    live = _Net("attn")
    with torch.no_grad():
        for p in live.parameters():
            p.zero_()
    live_opt = torch.optim.Adam(live.parameters())
    with pytest.raises(unickpt.MissingKeysError) as err:
        unickpt.load(str(tmp_path / "ck"), {"model": live, "optimizer": live_opt})
    msg = str(err.value)
    # key_map comes first, spelled with the rename it saw; strict=False after it, with its cost
    assert "key_map=lambda k: k.replace('.attention.', '.attn.')" in msg, msg
    assert msg.index("key_map") < msg.index("strict=False") and "initial values" in msg
    # the advice, followed, loads the renamed layer and its optimizer state
    opts = unickpt.LoadOptions(restore=RestoreOptions(key_map=lambda k: k.replace(".attention.", ".attn.")))
    unickpt.load(str(tmp_path / "ck"), {"model": live, "optimizer": live_opt}, options=opts)
    assert torch.equal(live.attn.weight, saved.attention.weight)
    assert torch.equal(live_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
