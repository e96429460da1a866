"""Storage backends behind one declared protocol, chosen by URL scheme from a registry.

``open_storage("ckpts/step_100")`` -> LocalStorage; ``memory://x`` -> MemoryStorage; each wrapped
in ``RetryingStorage``. The three places a new backend touches: a module implementing
``base.Storage`` with its ``StorageCapabilities``, one ``DEFAULT_REGISTRY.register(scheme,
"module:attr", extra=...)`` line, and one small test module running ``tests/fixtures/contract.py``
against it. Atomic publication on top of a backend (metadata commit, pointers, locks) is
``unickpt.folder.publish``.
"""

from __future__ import annotations

import os

from .base import Buffer, Storage, StorageCapabilities
from .options import StorageOptions
from .registry import DEFAULT_REGISTRY, Factory, StorageRegistry
from .retry import RetryPolicy, unwrap

__all__ = [
    "Storage",
    "StorageCapabilities",
    "Buffer",
    "StorageOptions",
    "RetryPolicy",
    "StorageRegistry",
    "DEFAULT_REGISTRY",
    "Factory",
    "open_storage",
    "register_storage",
    "registered_schemes",
    "absence",
]


def open_storage(url: str, options: StorageOptions | None = None) -> Storage:
    """The backend for ``url`` from ``DEFAULT_REGISTRY``, built with ``options`` and wrapped in
    ``RetryingStorage`` (``options.retry``)."""
    return DEFAULT_REGISTRY.open(url, options)


def register_storage(scheme: str, factory: str | Factory, *, extra: str | None = None, replace: bool = False) -> None:
    """Register ``factory(path, options) -> Storage`` (or ``"module:attr"``, imported when first
    used; ``extra``: the pip extra named when that import fails) for ``scheme://...`` URLs in
    ``DEFAULT_REGISTRY``."""
    DEFAULT_REGISTRY.register(scheme, factory, extra=extra, replace=replace)


def registered_schemes() -> list[str]:
    return DEFAULT_REGISTRY.schemes()


def absence(storage: Storage) -> str | None:
    """Why nothing can be read at ``storage`` at all, as a parenthesis for an error ("it does not
    exist"), or None when it exists (a local folder, or a prefix holding objects). Called only on
    the error paths of loads and tools: it lists or stats the location once."""
    from .local import LocalStorage

    inner = unwrap(storage)
    if isinstance(inner, LocalStorage):
        try:
            os.stat(inner.root)
        except (FileNotFoundError, NotADirectoryError):
            return "it does not exist"
        except OSError as e:
            return f"it cannot be read: {e.strerror or e}"
        return None
    return None if storage.list("") else "it does not exist: nothing is stored under it"
