"""Framework adapter protocol and registry.

An adapter translates live objects (``state["model"]``, ``state["optimizer"]``) to and from
unickpt's neutral shard specs; it performs no I/O and no collectives. ``engine`` calls, per rank:
  save: ``adapter.save_view(state)`` -> SaveView (items + JSON objects), then writes them;
  load: ``adapter.load_view(state)`` -> LoadView (destinations), fills them, then
        ``view.finish(objects)`` to apply non-tensor state (param_groups, step counters).
Adapters are registered by stable name (the name goes into checkpoints as information only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import FrameworkError
from ..format.records import JSONValue
from ..planning.specs import LoadItem, SaveItem

__all__ = [
    "SaveView",
    "LoadView",
    "FrameworkAdapter",
    "register_framework",
    "get_framework",
    "registered_frameworks",
    "MODEL_PREFIX",
    "OPTIM_PREFIX",
]

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optimizer."


@dataclass
class SaveView:
    items: list[SaveItem]
    objects: dict[str, JSONValue] = field(default_factory=dict)
    mesh: tuple[tuple[str, int], ...] = ()


@dataclass
class LoadView:
    items: list[LoadItem]
    # the checkpoint keys (tensor fqns / object keys) this view is responsible for
    prefixes: tuple[str, ...]
    finish: Callable[[Mapping[str, JSONValue], bool], list[str]] = lambda objects, strict: []


class FrameworkAdapter(Protocol):
    name: str

    def matches(self, state: Mapping[str, Any]) -> bool:
        """True if ``state`` looks like this framework's objects (used by framework="auto")."""

    def save_view(self, state: Mapping[str, Any]) -> SaveView: ...

    def load_view(self, state: Mapping[str, Any]) -> LoadView: ...


_REGISTRY: dict[str, FrameworkAdapter] = {}
# "auto" tries adapters in this order: the most specific wrappers first
_AUTO_ORDER: list[str] = []


def register_framework(adapter: FrameworkAdapter, *, auto_priority: int | None = None, replace: bool = False) -> None:
    if adapter.name in _REGISTRY and not replace:
        raise ValueError(f"framework {adapter.name!r} is already registered")
    _REGISTRY[adapter.name] = adapter
    if auto_priority is not None and adapter.name not in _AUTO_ORDER:
        _AUTO_ORDER.insert(min(auto_priority, len(_AUTO_ORDER)), adapter.name)


def registered_frameworks() -> list[str]:
    return sorted(_REGISTRY)


def get_framework(name: str, state: Mapping[str, Any]) -> FrameworkAdapter:
    if name == "auto":
        for candidate in _AUTO_ORDER:
            if _REGISTRY[candidate].matches(state):
                return _REGISTRY[candidate]
        return _REGISTRY["torch"]
    try:
        return _REGISTRY[name]
    except KeyError:
        raise FrameworkError(
            f"unknown framework {name!r}; known: {', '.join(['auto', *registered_frameworks()])}"
        ) from None
