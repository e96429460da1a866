"""Framework registry: adapters by name, and ``framework="auto"`` by explicit detection priority.

The place to add a framework: write an adapter (``base.FrameworkAdapter``: ``name``,
``matches``, ``describe``; subclass ``views.DescribedAdapter``) and register it::

    FRAMEWORKS.register(MyAdapter(), priority=250)   # or on a registry of your own

``resolve("auto", state)`` asks the adapters in decreasing priority whether ``state`` is theirs
(``matches``; adapters registered with ``priority=None`` are only chosen by name) and takes the
first level that answers yes: one adapter there wins, two or more at the same priority are an
ambiguity (``FrameworkError`` naming them; insertion order never decides); no match at any
level gives the fallback (``torch``).

Built-in priorities (``BUILTIN_PRIORITIES``), the most specific wrapper first, because a more
general adapter would accept the same objects but describe them wrongly or less precisely:
  fsdp (FSDP1)  400  flat parameters: any other adapter would save the FlatParameters
                     themselves under wrong names. A model with any FSDP1 unit is FSDP1's.
  megatron      350  megatron-core model chunks (classes defined in ``megatron.core``): its adapter
                     reads megatron's sharded_state_dict and the distributed optimizer's ranges,
                     which no generic adapter sees; above fsdp2 and dtensor in case its models
                     hold DTensors, below FSDP1, which Megatron does not wrap.
  fsdp2         300  ``fully_shard`` modules hold DTensors, so ``dtensor`` matches too (and FSDP2+TP
                     models are both): fsdp2 names the framework that owns the sharding.
  ddp           200  a DDP wrapper anywhere in the model (also under torch.compile's wrapper):
                     replicated buffers are saved from rank 0 of DDP's process group, the rank DDP
                     broadcasts them from. DDP over a TP (DTensor) model is DDP's, for that reason.
  dtensor       100  any DTensor parameter (``parallelize_module`` tensor parallelism).
  torch         None the fallback: plain modules (also under torch.compile), one process or
                     replicated without a wrapper.
A framework added later picks a number between these; gaps of 50-100 leave room to insert
between any two.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import FrameworkError
from .base import FrameworkAdapter

__all__ = ["FrameworkRegistry", "BUILTIN_PRIORITIES", "FRAMEWORKS", "get_framework", "registered_frameworks"]

BUILTIN_PRIORITIES: dict[str, int | None] = {
    "tensors": 500,  # only ever matches a FlatTensors
    "fsdp": 400,
    "megatron": 350,
    "fsdp2": 300,
    "ddp": 200,
    "dtensor": 100,
    "torch": None,
}


class FrameworkRegistry:
    """Adapters by stable name, each with an explicit ``framework="auto"`` detection priority.

    Owned by whoever resolves frameworks (the default instance ``FRAMEWORKS`` for
    ``unickpt.save`` / ``load``); tests create their own (``FrameworkRegistry()`` empty, or
    ``FrameworkRegistry.with_builtins()``)."""

    def __init__(self, *, fallback: str = "torch") -> None:
        self.fallback = fallback
        self._adapters: dict[str, FrameworkAdapter] = {}
        self._priority: dict[str, int | None] = {}

    @classmethod
    def with_builtins(cls) -> FrameworkRegistry:
        """A registry holding unickpt's adapters at ``BUILTIN_PRIORITIES``."""
        from .flat import FlatTensorsAdapter
        from .fsdp1 import FSDP1Adapter
        from .generic import DDPAdapter, DTensorAdapter, FSDP2Adapter, TorchAdapter
        from .megatron import MegatronAdapter

        reg = cls()
        adapters = (
            FlatTensorsAdapter(),
            FSDP1Adapter(),
            MegatronAdapter(),
            FSDP2Adapter(),
            DDPAdapter(),
            DTensorAdapter(),
            TorchAdapter(),
        )
        for adapter in adapters:
            reg.register(adapter, priority=BUILTIN_PRIORITIES[adapter.name])
        return reg

    def register(self, adapter: FrameworkAdapter, *, priority: int | None) -> None:
        """Add ``adapter`` under ``adapter.name``; ``priority``: its ``framework="auto"``
        detection priority (higher is asked first), None: chosen by name only. ValueError for a
        name already registered (``unregister`` it first) or an invalid name or priority."""
        name = getattr(adapter, "name", None)
        if not isinstance(name, str) or not name or name == "auto":
            raise ValueError(f"a framework adapter needs a non-empty name other than 'auto', got {name!r}")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise ValueError(f"framework {name!r}: priority must be an int or None, got {priority!r}")
        if name in self._adapters:
            raise ValueError(f"framework {name!r} is already registered (priority {self._priority[name]})")
        self._adapters[name] = adapter
        self._priority[name] = priority

    def unregister(self, name: str) -> FrameworkAdapter:
        """Remove and return the adapter registered as ``name``."""
        adapter = self.get(name)
        del self._adapters[name], self._priority[name]
        return adapter

    def names(self) -> list[str]:
        return sorted(self._adapters)

    def priorities(self) -> list[tuple[str, int | None]]:
        """(name, priority), in the order ``framework="auto"`` asks them (None: by name only)."""
        ranked = sorted((p, n) for n, p in self._priority.items() if p is not None)
        return [(n, p) for p, n in reversed(ranked)] + sorted((n, None) for n, p in self._priority.items() if p is None)

    def get(self, name: str) -> FrameworkAdapter:
        """The adapter registered as ``name``; FrameworkError naming the known ones."""
        try:
            return self._adapters[name]
        except KeyError:
            raise FrameworkError(f"unknown framework {name!r}; known: {', '.join(['auto', *self.names()])}") from None

    def detect(self, state: Mapping[str, Any]) -> FrameworkAdapter:
        """``framework="auto"``: the highest-priority adapter whose ``matches(state)`` is true."""
        levels: dict[int, list[str]] = {}
        for name, prio in self._priority.items():
            if prio is not None:
                levels.setdefault(prio, []).append(name)
        for prio in sorted(levels, reverse=True):
            hits = [n for n in sorted(levels[prio]) if self._matches(n, state)]
            if len(hits) > 1:
                raise FrameworkError(
                    f"framework='auto' is ambiguous: adapters {' and '.join(repr(h) for h in hits)} both "
                    f"match this state at the same detection priority {prio}; pass framework= explicitly "
                    "(or register them with different priorities)"
                )
            if hits:
                return self._adapters[hits[0]]
        if self.fallback not in self._adapters:
            raise FrameworkError(
                f"framework='auto': no registered framework matches this state and the fallback "
                f"{self.fallback!r} is not registered; known: {', '.join(self.names())}"
            )
        return self._adapters[self.fallback]

    def resolve(self, name: str, state: Mapping[str, Any]) -> FrameworkAdapter:
        """The adapter for ``framework=name`` (``"auto"``: ``detect``)."""
        return self.detect(state) if name == "auto" else self.get(name)

    def _matches(self, name: str, state: Mapping[str, Any]) -> bool:
        try:
            return bool(self._adapters[name].matches(state))
        except Exception as e:
            raise FrameworkError(f"framework='auto': adapter {name!r} failed to inspect the state: {e!r}") from e


# the registry unickpt.save / unickpt.load resolve ``framework=`` in
FRAMEWORKS = FrameworkRegistry.with_builtins()


def get_framework(name: str, state: Mapping[str, Any]) -> FrameworkAdapter:
    """``FRAMEWORKS.resolve(name, state)``."""
    return FRAMEWORKS.resolve(name, state)


def registered_frameworks() -> list[str]:
    """The names registered in ``FRAMEWORKS``."""
    return FRAMEWORKS.names()
