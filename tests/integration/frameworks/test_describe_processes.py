"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/frameworks/test_describe.py``, which holds its single-process tests."""

from __future__ import annotations

import torch

from tests.unit.frameworks.test_describe import _assert_same, _compare, _where
from tests.workers.harness import run_ranks
from unickpt.testing.toy import build, train_step


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


def test_save_and_load_views_are_one_description_every_framework(tmp_path):
    res = run_ranks(_compare_all, 2, str(tmp_path), timeout=300)
    for rank, per in enumerate(res):
        for name, r in per.items():
            _assert_same(f"{name} rank {rank}", r)
        assert per["fsdp"]["probes"] > 0  # the flat parameters' shared step
        assert per["fsdp-orig"]["probes"] == 0


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
