"""Storage backends behind one small protocol, chosen by URL scheme from a registry.

``open_storage("ckpts/step_100")`` -> LocalStorage; ``memory://x`` -> MemoryStorage. Backends are
registered by scheme with a factory that imports lazily, so optional dependencies (s3fs, ...) are
needed only when used; unknown schemes raise with the list of known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import StorageError
from .base import Buffer, Storage

if TYPE_CHECKING:
    from .retry import RetryPolicy

__all__ = ["Storage", "Buffer", "open_storage", "register_storage", "registered_schemes"]

_REGISTRY: dict[str, Callable[[str], Storage]] = {}


def register_storage(scheme: str, factory: Callable[[str], Storage], *, replace: bool = False) -> None:
    """Register ``factory(path_without_scheme) -> Storage`` for URLs ``scheme://...``."""
    if scheme in _REGISTRY and not replace:
        raise ValueError(f"storage scheme {scheme!r} is already registered")
    _REGISTRY[scheme] = factory


def registered_schemes() -> list[str]:
    return sorted(_REGISTRY)


def open_storage(url: str, retry: RetryPolicy | None = None) -> Storage:
    """The backend for ``url``, wrapped in ``RetryingStorage`` (``retry``: its policy)."""
    from .retry import RetryingStorage

    scheme, sep, rest = str(url).partition("://")
    if not sep:
        scheme, rest = "file", str(url)
    try:
        factory = _REGISTRY[scheme]
    except KeyError:
        raise StorageError(f"no storage backend for {scheme}:// (known: {', '.join(registered_schemes())})") from None
    backend = factory(rest)
    return backend if isinstance(backend, RetryingStorage) else RetryingStorage(backend, retry)


def _local(path: str) -> Storage:
    from .local import LocalStorage

    return LocalStorage(path)


def _memory(path: str) -> Storage:
    from .memory import MemoryStorage

    return MemoryStorage(path)


register_storage("file", _local)
register_storage("memory", _memory)
