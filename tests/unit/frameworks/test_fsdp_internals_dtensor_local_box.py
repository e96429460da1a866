"""``dtensor_local_box`` gives the box torch's ``__create_chunk_list__`` gives, for every layout,
without importing torch.distributed.checkpoint (0.1-0.2 s in a fresh process's first load).

One process: torch's fake process group (no peers, no collectives) at world size 4 as rank 1,
DTensors made with ``DTensor.from_local`` (no communication)."""

from __future__ import annotations

import builtins

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from unickpt.frameworks import _fsdp_internals as internals

RANK, WORLD = 1, 4


@pytest.fixture(scope="module")
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _dtensor(mesh_shape: tuple[int, ...], placements: tuple, global_shape: tuple[int, ...]) -> DTensor:
    """A DTensor of ``global_shape`` with this rank's local shard (zeros) of the right shape."""
    mesh = init_device_mesh("cpu", mesh_shape)
    local_shape = [*global_shape]
    coord = mesh.get_coordinate()
    assert coord is not None
    for dim_of_mesh, p in enumerate(placements):
        if p.is_shard():
            n = local_shape[p.dim]
            parts = [len(c) for c in torch.arange(n).chunk(mesh_shape[dim_of_mesh])]
            parts += [0] * (mesh_shape[dim_of_mesh] - len(parts))
            local_shape[p.dim] = parts[coord[dim_of_mesh]]
    stride = torch.empty(global_shape).stride()
    return DTensor.from_local(
        torch.zeros(local_shape), mesh, placements, run_check=False, shape=torch.Size(global_shape), stride=stride
    )


LAYOUTS = [
    ((4,), (Shard(0),), (10, 3)),  # uneven rows: 3, 3, 3, 1
    ((4,), (Shard(0),), (2, 5)),  # fewer rows than ranks: rank 1 holds row 1
    ((4,), (Shard(1),), (3, 9)),
    ((4,), (Replicate(),), (6, 2)),
    ((2, 2), (Shard(0), Shard(1)), (7, 5)),  # FSDP2 + TP
    ((2, 2), (Replicate(), Shard(0)), (9,)),  # HSDP
    ((2, 2), (Shard(0), Shard(0)), (11, 2)),
]


@pytest.mark.parametrize(("mesh_shape", "placements", "shape"), LAYOUTS)
def test_box_is_torchs_without_importing_dcp(fake_group, monkeypatch, mesh_shape, placements, shape):
    t = _dtensor(mesh_shape, placements, shape)
    imported: list[str] = []
    real_import = builtins.__import__

    def watch(name, globals=None, locals=None, fromlist=(), level=0):
        if name.startswith("torch.distributed.checkpoint"):
            imported.append(name)
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", watch)
    got = internals.dtensor_local_box(t)
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert imported == []
    (chunk,) = t.__create_chunk_list__()
    assert got == (tuple(chunk.offsets), tuple(chunk.sizes))


def test_box_by_hand(fake_group):
    # 10 rows over 4 ranks, torch.chunk: 3, 3, 3, 1 -> rank 1 holds rows [3, 6)
    assert internals.dtensor_local_box(_dtensor((4,), (Shard(0),), (10, 3))) == ((3, 0), (3, 3))
    # mesh (2, 2), rank 1 = coordinate (0, 1): rows [0, 4) of 7, columns [3, 5) of 5
    assert internals.dtensor_local_box(_dtensor((2, 2), (Shard(0), Shard(1)), (7, 5))) == ((0, 3), (4, 2))
