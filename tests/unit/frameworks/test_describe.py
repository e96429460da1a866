"""One description, two views: what a rank saves and where a load puts it are the same pieces.

For every built-in adapter (torch; ddp, fsdp2, dtensor, fsdp2+tp, FSDP1 flat and
use_orig_params on 2 gloo ranks), after a training step and a save of the live state, the
load view of that same state from that checkpoint must name exactly the save view's boxes, and
every live destination must be the very memory the save reads (same storage address, shape and
strides); values one tensor holds for several keys (an FSDP1 flat ``step``) are probes. And the
load path refuses what the save path refuses (an optimizer parameter outside the model)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import unickpt
from tests.workers.harness import run_ranks
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


def _compare_all(rank: int, ws: int, root: str) -> dict:
    cases = {
        "ddp": "ddp",
        "fsdp2": "fsdp2",
        "dtensor": "dtensor",
        "fsdp2+tp": "fsdp2",
        "fsdp": "fsdp",
        "fsdp-orig": "fsdp",
    }
    return {spec: _compare(fw, spec, f"{root}/{spec}") for spec, fw in cases.items()}


def _assert_same(name: str, r: dict) -> None:
    assert r["n"] > 0 and r["duplicates"] == 0, (name, r)
    assert r["only_saved"] == [] and r["only_loaded"] == [], (name, r)
    assert r["moved"] == [] and r["scratch_saved"] == [], (name, r)


def test_save_and_load_views_are_one_description_torch(tmp_path):
    r = _compare("torch", "torch", str(tmp_path / "torch"))
    _assert_same("torch", r)
    assert r["probes"] == 0


def test_save_and_load_views_are_one_description_every_framework(tmp_path):
    res = run_ranks(_compare_all, 2, str(tmp_path), timeout=300)
    for rank, per in enumerate(res):
        for name, r in per.items():
            _assert_same(f"{name} rank {rank}", r)
        assert per["fsdp"]["probes"] > 0  # the flat parameters' shared step
        assert per["fsdp-orig"]["probes"] == 0


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


def _memo_against_torch(rank: int, ws: int) -> dict:
    """Every DTensor / plain tensor described through one ``BoxMemo`` (twice: the second pass
    hits it) gets exactly the spec that torch's ``__create_chunk_list__`` gives without it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from unickpt.frameworks.module_state import BoxMemo, tensor_piece
    from unickpt.testing.toy import ToyConfig

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tensors: list[torch.Tensor] = []
    for shape in [(5,), (7, 3), (1, 9), (0, 4), (4, 0), (3, 5, 2), (8, 8), ()]:
        for placements in [
            (Shard(0), Shard(0)),
            (Shard(0), Shard(1)),
            (Replicate(), Shard(0)),
            (Shard(1), Replicate()),
            (Replicate(), Replicate()),
            (Shard(-1), Shard(0)),
        ]:
            if any(isinstance(p, Shard) and (p.dim >= len(shape) or -p.dim > len(shape)) for p in placements):
                continue
            tensors.append(distribute_tensor(torch.randn(shape), mesh, placements))
            tensors.append(torch.randn(shape))  # plain: the full box
    model, optim = build("fsdp2+tp", ToyConfig(), seed=0)  # FSDP2 over TP: strided shards
    train_step(model, optim, 0)
    tensors += list(model.parameters()) + [v for st in optim.state.values() for v in st.values()]
    tensors.append(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0), Replicate()]).to(torch.bfloat16))
    memo = BoxMemo()
    wrong = []
    for i, t in enumerate(tensors * 2):
        got, want = tensor_piece(f"k{i}", t, 3, memo), tensor_piece(f"k{i}", t, 3)
        if got.spec != want.spec or _where(got.tensor) != _where(want.tensor):
            wrong.append(f"{got.spec} != {want.spec}")
    return {"wrong": wrong, "n": len(tensors), "layouts": len(memo.dtensors) + len(memo.plain)}


def test_box_memo_gives_the_boxes_torch_gives():
    """The describe stage memoises DTensor boxes by (global shape, mesh, placements); on 4
    ranks (2x2 mesh: uneven, empty, replicated, strided FSDP2+TP shards) each memoised spec
    equals the one computed by torch for that tensor."""
    for rank, r in enumerate(run_ranks(_memo_against_torch, 4, timeout=300)):
        assert r["wrong"] == [], (rank, r["wrong"][:5])
        assert r["n"] > 2 * r["layouts"] > 0, r  # the memo was hit


def test_checked_box_specs_equal_checked_specs():
    from unickpt.planning.specs import ShardSpec

    args = ("model.w", "float32", (4, 6), (2, 0), (2, 6), 1)
    assert ShardSpec.checked_box(*args) == ShardSpec(*args)
    assert hash(ShardSpec.checked_box(*args)) == hash(ShardSpec(*args))
    with pytest.raises(ValueError, match="outside"):
        ShardSpec("model.w", "float32", (4, 6), (3, 0), (2, 6))
