"""Framework adapter protocol and registry.

An adapter translates live objects (``state["model"]``, ``state["optimizer"]``) to and from
unickpt's neutral shard specs; it performs no I/O and no collectives. ``api`` calls, per rank:
  save: ``adapter.save_view(state)`` -> SaveView (items + JSON objects), then writes them;
  load: ``adapter.load_view(state, md, strict)`` -> LoadView: destinations (live tensors, or
        fresh ones for optimizer state the live optimizer lacks) and nothing changed yet ->
        ``probes`` read -> ``view.validate()`` (non-tensor state: param groups, hyper-parameter
        types, flat steps) -> every rank agrees -> the engine fills ``items`` ->
        ``view.apply()`` installs fresh state, drops state the checkpoint does not have,
        sets param groups. A refused load therefore leaves the job as it was.
Adapters are registered by stable name (the name goes into checkpoints as information only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import FrameworkError
from ..format.records import JSONValue, Metadata
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


def _no_keys() -> tuple[list[str], list[str]]:
    return [], []


def _nothing() -> None:
    return None


@dataclass
class LoadView:
    items: list[LoadItem]
    # the checkpoint keys (tensor fqns / object keys) this view is responsible for
    prefixes: tuple[str, ...]
    # small scratch destinations read before ``validate`` (never live tensors)
    probes: list[LoadItem] = field(default_factory=list)
    # checks of the non-tensor state, no side effects: (missing keys, unexpected keys)
    validate: Callable[[], tuple[list[str], list[str]]] = _no_keys
    # after every rank validated and read: make the loaded state the live state
    apply: Callable[[], None] = _nothing


class FrameworkAdapter(Protocol):
    name: str

    def matches(self, state: Mapping[str, Any]) -> bool:
        """True if ``state`` looks like this framework's objects (used by framework="auto")."""

    def save_view(self, state: Mapping[str, Any]) -> SaveView: ...

    def load_view(self, state: Mapping[str, Any], md: Metadata | None = None, strict: bool = True) -> LoadView:
        """Destinations for checkpoint ``md`` (None: only the live tensors); no side effects."""


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
