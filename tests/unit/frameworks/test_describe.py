"""One description, two views: what a rank saves and where a load puts it are the same pieces.

For every built-in adapter (torch; ddp, fsdp2, dtensor, fsdp2+tp, FSDP1 flat and
use_orig_params on 2 gloo ranks), after a training step and a save of the live state, the
load view of that same state from that checkpoint must name exactly the save view's boxes, and
every live destination must be the very memory the save reads (same storage address, shape and
strides); values one tensor holds for several keys (an FSDP1 flat ``step``) are probes. And the
load path refuses what the save path refuses (an optimizer parameter outside the model).

Its tests that start processes are in ``tests/integration/frameworks/test_describe_processes.py``."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import unickpt
from unickpt.errors import FrameworkError
from unickpt.format import METADATA_FILE, decode_metadata
from unickpt.frameworks import FRAMEWORKS
from unickpt.testing.toy import build, train_step


def _where(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _compare(framework: str, spec: str, ckpt: str) -> dict:
    """Save the live state, then compare its save view with its load view from that checkpoint."""
    model, optim = build(spec.replace("-orig", ""), seed=0, use_orig_params=spec.endswith("-orig"))
    train_step(model, optim, 0)
    state = {"model": model, "optimizer": optim}
    unickpt.save(ckpt, state, framework=framework).wait()
    with open(os.path.join(ckpt, METADATA_FILE), "rb") as f:
        md = decode_metadata(f.read())
    adapter = FRAMEWORKS.get(framework)
    saved = adapter.save_view(state)
    loaded = adapter.load_view(state, md)
    box = lambda s: (s.fqn, s.offsets, s.lengths, s.global_shape, s.dtype)  # noqa: E731
    save_boxes = {box(i.spec): i for i in saved.items}
    live = {box(i.spec): i for i in loaded.items if not i.fresh}
    probes = {box(i.spec) for i in loaded.probes}
    scratch = {box(i.spec) for i in loaded.items if i.fresh}  # 0-d tensors another rank holds
    return {
        "n": len(save_boxes),
        "duplicates": len(saved.items) - len(save_boxes),
        "only_saved": sorted(str(k) for k in set(save_boxes) - set(live) - probes),
        "only_loaded": sorted(str(k) for k in set(live) | probes if k not in save_boxes),
        "moved": sorted(
            str(k) for k in set(live) & set(save_boxes) if _where(live[k].tensor) != _where(save_boxes[k].tensor)
        ),
        "scratch_saved": sorted(str(k) for k in scratch & set(save_boxes)),
        "probes": len(probes),
    }


def _assert_same(name: str, r: dict) -> None:
    assert r["n"] > 0 and r["duplicates"] == 0, (name, r)
    assert r["only_saved"] == [] and r["only_loaded"] == [], (name, r)
    assert r["moved"] == [] and r["scratch_saved"] == [], (name, r)


def test_save_and_load_views_are_one_description_torch(tmp_path):
    r = _compare("torch", "torch", str(tmp_path / "torch"))
    _assert_same("torch", r)
    assert r["probes"] == 0


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)


def test_load_refuses_an_optimizer_parameter_outside_the_model_like_save(tmp_path):
    """The same description serves both directions, so load refuses what save refuses, with
    the same FrameworkError (it used to fail with a bare KeyError at load)."""
    model = _Tiny()
    ckpt = str(tmp_path / "c")
    unickpt.save(ckpt, {"model": model}, framework="torch")
    stray = nn.Parameter(torch.zeros(4))
    optim = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    for call in (unickpt.save, unickpt.load):
        with pytest.raises(FrameworkError, match="param group 0 holds a parameter .*not in the model"):
            call(ckpt, {"model": model, "optimizer": optim}, framework="torch")


def test_checked_box_specs_equal_checked_specs():
    from unickpt.planning.specs import ShardSpec

    args = ("model.w", "float32", (4, 6), (2, 0), (2, 6), 1)
    assert ShardSpec.checked_box(*args) == ShardSpec(*args)
    assert hash(ShardSpec.checked_box(*args)) == hash(ShardSpec(*args))
    with pytest.raises(ValueError, match="outside"):
        ShardSpec("model.w", "float32", (4, 6), (3, 0), (2, 6))
