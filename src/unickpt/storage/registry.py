"""Storage backends by URL scheme: a registry object, with lazily imported factories.

``DEFAULT_REGISTRY`` knows ``file`` (also any path without ``scheme://``), ``memory``, ``shm``, ``s3``,
``gs``, ``az`` / ``abfs`` and ``hdfs``; a backend is added the same way, one line each::

    DEFAULT_REGISTRY.register("s3", "unickpt.storage.s3:S3Storage", extra="s3")

A factory is ``factory(path, options) -> Storage``: ``path`` is the URL without ``scheme://``,
``options`` a ``StorageOptions``. Given as a ``"module:attr"`` string it is imported the first
time a URL of its scheme is opened, so optional client libraries (s3fs, hdfs-native) are needed
only by jobs that use them; a failed import raises ``MissingDependencyError`` naming the pip
extra to install (``pip install 'unickpt[s3]'``). Registering a scheme twice is an error unless
``replace=True``. Tests create their own ``StorageRegistry`` or replace a scheme of the default one.

``open(url, options)`` wraps every backend in ``RetryingStorage`` (``options.retry``) unless the
factory returned one already.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import MissingDependencyError, StorageError
from .base import Storage
from .options import StorageOptions
from .retry import RetryingStorage

__all__ = ["Factory", "BackendEntry", "StorageRegistry", "DEFAULT_REGISTRY", "split_url"]

Factory = Callable[[str, StorageOptions], Storage]
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]{0,31}")
_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """One registered scheme: its factory (a callable, or ``"module:attr"`` imported on first
    use) and the pip extra that installs the factory's dependencies (None: none needed)."""

    scheme: str
    factory: str | Factory
    extra: str | None = None


def split_url(url: str) -> tuple[str, str]:
    """``(scheme, rest)``; a plain path is ``("file", path)``."""
    scheme, sep, rest = str(url).partition("://")
    return (scheme, rest) if sep else ("file", str(url))


class StorageRegistry:
    """Scheme -> backend factory. Thread-safe; independent instances share nothing."""

    def __init__(self) -> None:
        self._entries: dict[str, BackendEntry] = {}
        self._lock = threading.Lock()

    def register(self, scheme: str, factory: str | Factory, *, extra: str | None = None, replace: bool = False) -> None:
        """Register ``factory`` for URLs ``scheme://...`` (``ValueError`` if the scheme is taken
        and not ``replace``, or malformed)."""
        if not isinstance(scheme, str) or _SCHEME.fullmatch(scheme) is None:
            raise ValueError(f"invalid storage scheme {scheme!r}: lower-case letters, digits, '+', '-', '.'")
        if isinstance(factory, str) and _TARGET.fullmatch(factory) is None:
            raise ValueError(f"storage factory {factory!r} for {scheme}:// is not of the form 'module:attr'")
        if not isinstance(factory, str) and not callable(factory):
            raise ValueError(f"storage factory for {scheme}:// must be callable or a 'module:attr' string")
        with self._lock:
            if scheme in self._entries and not replace:
                raise ValueError(f"storage scheme {scheme!r} is already registered")
            self._entries[scheme] = BackendEntry(scheme, factory, extra)

    def unregister(self, scheme: str) -> None:
        """Forget ``scheme`` (missing: ignored)."""
        with self._lock:
            self._entries.pop(scheme, None)

    def schemes(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def entry(self, scheme: str) -> BackendEntry:
        with self._lock:
            found = self._entries.get(scheme)
        if found is None:
            known = ", ".join(self.schemes()) or "none"
            raise StorageError(f"no storage backend for {scheme}:// (known: {known})")
        return found

    def factory(self, scheme: str) -> Factory:
        """The factory of ``scheme``, importing it now when given as ``"module:attr"``."""
        entry = self.entry(scheme)
        if not isinstance(entry.factory, str):
            return entry.factory
        module_name, _, attr = entry.factory.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            hint = f"pip install 'unickpt[{entry.extra}]'" if entry.extra else "install the library it needs"
            raise MissingDependencyError(
                f"the storage backend for {scheme}:// ({entry.factory}) cannot be imported: {e}; {hint}"
            ) from e
        target: object = module
        for part in attr.split("."):
            try:
                target = getattr(target, part)
            except AttributeError:
                raise StorageError(
                    f"storage backend for {scheme}://: {module_name} has no {attr!r} (registered as {entry.factory})"
                ) from None
        if not callable(target):
            raise StorageError(f"storage backend for {scheme}://: {entry.factory} is not callable")
        return target  # type: ignore[return-value]

    def open(self, url: str, options: StorageOptions | None = None) -> Storage:
        """The backend for ``url``, built with ``options``, wrapped in ``RetryingStorage``."""
        options = options if options is not None else StorageOptions()
        scheme, rest = split_url(url)
        backend = self.factory(scheme)(rest, options)
        return backend if isinstance(backend, RetryingStorage) else RetryingStorage(backend, options.retry)


def builtin_registry() -> StorageRegistry:
    """A registry with unickpt's built-in backends (``file``, ``memory``, ``s3``, ``gs``, ``az``, ``abfs``,
    ``shm``, ``hdfs``)."""
    reg = StorageRegistry()
    reg.register("file", "unickpt.storage.local:LocalStorage")
    reg.register("memory", "unickpt.storage.memory:MemoryStorage")
    reg.register("s3", "unickpt.storage.s3:S3Storage", extra="s3")
    reg.register("gs", "unickpt.storage.gcs:GcsStorage", extra="gcs")
    reg.register("az", "unickpt.storage.azure:AzureBlobStorage", extra="azure")
    reg.register("abfs", "unickpt.storage.azure:abfs_storage", extra="azure")
    reg.register("shm", "unickpt.storage.shm:ShmStorage")
    reg.register("hdfs", "unickpt.storage.hdfs:HdfsStorage", extra="hdfs")
    return reg


DEFAULT_REGISTRY = builtin_registry()
