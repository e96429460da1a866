"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/frameworks/test_frameworks_registry.py``, which holds its single-process tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.workers.harness import run_ranks
from unickpt.frameworks import FRAMEWORKS


def _detect(rank: int, ws: int) -> dict[str, str]:
    """framework="auto" for each framework's objects (compiled too), and the replica source of
    a compiled DDP model's buffers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    cpu = torch.device("cpu")

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4), nn.BatchNorm1d(4))

    def tp(m: nn.Module, mesh: Any) -> nn.Module:
        return parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def fsdp2(m: nn.Module) -> nn.Module:
        fully_shard(m[0])
        fully_shard(m)
        return m

    def fsdp2_tp() -> nn.Module:
        mesh = init_device_mesh("cpu", (1, ws), mesh_dim_names=("dp", "tp"))
        m = tp(net(), mesh["tp"])
        fully_shard(m, mesh=mesh["dp"])
        return m

    cases = {
        "torch": net,
        "torch-compiled": lambda: torch.compile(net()),
        "ddp": lambda: DistributedDataParallel(net()),
        "ddp-of-compiled": lambda: DistributedDataParallel(torch.compile(net())),
        "compiled-ddp": lambda: torch.compile(DistributedDataParallel(net())),
        "fsdp2": lambda: fsdp2(net()),
        "fsdp2-compiled": lambda: torch.compile(fsdp2(net())),
        "dtensor": lambda: tp(net(), init_device_mesh("cpu", (ws,))),
        "dtensor-compiled": lambda: torch.compile(tp(net(), init_device_mesh("cpu", (ws,)))),
        "fsdp2+tp": fsdp2_tp,
        "fsdp": lambda: FullyShardedDataParallel(net(), device_id=cpu),
        "fsdp-orig": lambda: FullyShardedDataParallel(net(), use_orig_params=True, device_id=cpu),
        "fsdp-compiled": lambda: torch.compile(FullyShardedDataParallel(net(), device_id=cpu)),
    }
    out = {}
    for case, make in cases.items():
        model = make()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        out[case] = FRAMEWORKS.resolve("auto", {"model": model, "optimizer": optim}).name
    out["no-model"] = FRAMEWORKS.resolve("auto", {"extra_state": {"step": 1}}).name
    # a compiled DDP model's buffers are saved from rank 0 of DDP's group, as DDP broadcasts them
    view = FRAMEWORKS.get("ddp").save_view({"model": torch.compile(DistributedDataParallel(net()))})
    out["compiled-ddp-buffer-source"] = str(
        {i.spec.replica_source for i in view.items if i.spec.fqn.startswith("model.3.running")}
    )
    return out


def test_auto_detection_of_each_framework_incl_compiled_and_fsdp2_tp():
    res = run_ranks(_detect, 2, timeout=240)
    expect = {
        "torch": "torch",
        "torch-compiled": "torch",
        "ddp": "ddp",
        "ddp-of-compiled": "ddp",
        "compiled-ddp": "ddp",  # DDP under torch.compile's wrapper (was: torch)
        "fsdp2": "fsdp2",
        "fsdp2-compiled": "fsdp2",
        "dtensor": "dtensor",
        "dtensor-compiled": "dtensor",
        "fsdp2+tp": "fsdp2",  # fsdp2 and dtensor both match: fsdp2's priority is higher
        "fsdp": "fsdp",
        "fsdp-orig": "fsdp",
        "fsdp-compiled": "fsdp",
        "no-model": "torch",
        "compiled-ddp-buffer-source": "{0}",
    }
    for rank, r in enumerate(res):
        assert r == expect, (rank, {k: (r.get(k), v) for k, v in expect.items() if r.get(k) != v})
