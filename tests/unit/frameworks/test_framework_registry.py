"""Framework registry: explicit detection priorities, ambiguity as an error, and what
``framework="auto"`` picks for each framework's real objects (gloo, 2 ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from tests.workers.harness import run_ranks
from unickpt.errors import FrameworkError
from unickpt.frameworks import BUILTIN_PRIORITIES, FRAMEWORKS, FrameworkRegistry


class Fake:
    """An adapter that matches when ``state["model"]`` carries its tag."""

    def __init__(self, name: str, tag: str | None = None) -> None:
        self.name = name
        self.tag = tag or name

    def matches(self, state: Any) -> bool:
        return self.tag in getattr(state.get("model"), "tags", ())

    def describe(self, state: Any) -> None:
        return None


def _state(*tags: str) -> dict:
    model = nn.Linear(1, 1)
    model.tags = tags  # type: ignore[assignment]
    return {"model": model}


def test_adapters_register_with_explicit_priority_highest_match_wins():
    reg = FrameworkRegistry()
    reg.register(Fake("torch"), priority=None)
    reg.register(Fake("low"), priority=10)
    reg.register(Fake("high"), priority=20)
    reg.register(Fake("byname"), priority=None)
    assert reg.priorities() == [("high", 20), ("low", 10), ("byname", None), ("torch", None)]
    assert reg.resolve("auto", _state("low", "high")).name == "high"  # registered later, asked first
    assert reg.resolve("auto", _state("low")).name == "low"
    assert reg.resolve("auto", _state("byname")).name == "torch"  # priority None: never detected
    assert reg.resolve("auto", _state()).name == "torch"  # the fallback
    assert reg.resolve("byname", _state()).name == "byname"


def test_same_priority_both_matching_is_an_error_naming_both_never_insertion_order():
    reg = FrameworkRegistry()
    reg.register(Fake("torch"), priority=None)
    reg.register(Fake("zeta", "x"), priority=5)
    reg.register(Fake("alpha", "x"), priority=5)
    reg.register(Fake("lower", "x"), priority=1)
    with pytest.raises(FrameworkError, match="ambiguous") as info:
        reg.resolve("auto", _state("x"))
    assert "'alpha' and 'zeta'" in str(info.value) and "priority 5" in str(info.value)
    reg.unregister("zeta")
    assert reg.resolve("auto", _state("x")).name == "alpha"
    # the same priority is fine as long as only one of them matches
    reg.register(Fake("other", "y"), priority=5)
    assert reg.resolve("auto", _state("x")).name == "alpha"


def test_registry_refuses_duplicates_and_invalid_registrations():
    reg = FrameworkRegistry()
    reg.register(Fake("a"), priority=1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register(Fake("a"), priority=2)
    for bad in (1.5, True, "3"):
        with pytest.raises(ValueError, match="priority"):
            reg.register(Fake("b"), priority=bad)  # type: ignore[arg-type]
    for name in ("", "auto"):
        with pytest.raises(ValueError, match="name"):
            reg.register(Fake(name), priority=1)
    with pytest.raises(FrameworkError, match=r"unknown framework 'nope'; known: auto, a"):
        reg.get("nope")
    # nothing matches and no fallback registered
    with pytest.raises(FrameworkError, match="fallback 'torch' is not registered"):
        reg.resolve("auto", _state())


def test_detection_failure_of_an_adapter_is_a_framework_error():
    class Broken(Fake):
        def matches(self, state: Any) -> bool:
            raise RuntimeError("boom")

    reg = FrameworkRegistry.with_builtins()
    reg.register(Broken("broken"), priority=1000)
    with pytest.raises(FrameworkError, match="'broken' failed to inspect the state.*boom"):
        reg.resolve("auto", _state())


def test_builtin_priorities_are_the_documented_ones_and_registries_are_independent():
    assert FrameworkRegistry.with_builtins().priorities() == [
        ("tensors", 500),  # only ever matches a unickpt.FlatTensors (tools' checkpoints from elsewhere)
        ("fsdp", 400),
        ("megatron", 350),  # megatron-core model chunks
        ("fsdp2", 300),
        ("ddp", 200),
        ("dtensor", 100),
        ("torch", None),
    ]
    assert dict(FRAMEWORKS.priorities()) == BUILTIN_PRIORITIES
    mine = FrameworkRegistry.with_builtins()
    mine.register(Fake("mine"), priority=1)
    assert "mine" not in FRAMEWORKS.names()


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


def test_unknown_framework_names_registered_ones(tmp_path):
    with pytest.raises(FrameworkError, match="known: auto, ddp, dtensor, fsdp, fsdp2, megatron, tensors, torch"):
        unickpt.save(str(tmp_path / "c"), {"model": nn.Linear(1, 1)}, framework="deepspeed")
