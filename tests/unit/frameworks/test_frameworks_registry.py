"""Framework registry: explicit detection priorities, ambiguity as an error, and what
``framework="auto"`` picks for each framework's real objects (gloo, 2 ranks).

Its tests that start processes are in ``tests/integration/frameworks/test_framework_registry_processes.py``."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

import unickpt
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


def test_unknown_framework_names_registered_ones(tmp_path):
    with pytest.raises(FrameworkError, match="known: auto, ddp, dtensor, fsdp, fsdp2, megatron, tensors, torch"):
        unickpt.save(str(tmp_path / "c"), {"model": nn.Linear(1, 1)}, framework="deepspeed")
