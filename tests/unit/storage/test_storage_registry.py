"""The scheme registry: an object (a default instance; tests make their own), factories given as
lazily imported ``module:attr`` strings with the pip extra to name when the import fails,
duplicate schemes refused; ``open_storage(url, options)`` with a frozen ``StorageOptions``; no
environment variable read at import time.

Its tests that start processes are in ``tests/integration/storage/test_storage_registry_processes.py``."""

from __future__ import annotations

import os
import sys

import pytest

from unickpt.errors import CheckpointError, StorageError
from unickpt.storage import open_storage
from unickpt.storage.local import LocalStorage
from unickpt.storage.memory import MemoryStorage
from unickpt.storage.retry import RetryingStorage, RetryPolicy


def test_a4_direct_reads_env_default_is_resolved_when_the_backend_is_created(tmp_path, monkeypatch):
    """``UNICKPT_DIRECT_READS`` set after ``unickpt`` was imported still takes effect (a
    documented default, read when a backend is created); an explicit option wins over it."""
    from unickpt.storage import local

    s = LocalStorage(str(tmp_path))
    s.write("f.bin", [bytes(3 << 20)])
    flags: list[int] = []
    real_open = os.open

    def spy(p, f, *a, **k):
        if not f & os.O_DIRECTORY:  # the file's open, not its folders'
            flags.append(f)
        return real_open(p, f, *a, **k)

    monkeypatch.setattr(local.os, "open", spy)

    def direct_flags(storage: LocalStorage) -> list[bool]:
        flags.clear()
        storage.read_into("f.bin", 0, memoryview(bytearray(2 << 20)))
        return [bool(f & os.O_DIRECT) for f in flags]

    monkeypatch.setenv("UNICKPT_DIRECT_READS", "1")
    assert direct_flags(LocalStorage(str(tmp_path))) == [True]
    monkeypatch.setenv("UNICKPT_DIRECT_READS", "0")
    assert direct_flags(LocalStorage(str(tmp_path))) == [False]
    from unickpt.storage import StorageOptions

    monkeypatch.setenv("UNICKPT_DIRECT_READS", "1")
    assert direct_flags(LocalStorage(str(tmp_path), StorageOptions(direct_reads=False))) == [False]
    monkeypatch.setenv("UNICKPT_DIRECT_READS", "0")
    assert direct_flags(LocalStorage(str(tmp_path), StorageOptions(direct_reads=True))) == [True]


def test_a4_lazy_factory_string_and_install_hint(tmp_path):
    """A backend given as ``module:attr`` is imported only when a URL of its scheme is opened;
    a missing client library names the pip extra to install."""
    from unickpt.errors import MissingDependencyError
    from unickpt.storage import StorageRegistry

    reg = StorageRegistry()
    reg.register("fakes3", "unickpt_no_such_client_module:S3Storage", extra="s3")
    assert "unickpt_no_such_client_module" not in sys.modules
    assert reg.schemes() == ["fakes3"]
    with pytest.raises(MissingDependencyError) as ei:
        reg.open("fakes3://bucket/ckpt")
    msg = str(ei.value)
    assert "pip install 'unickpt[s3]'" in msg and "fakes3://" in msg and "unickpt_no_such_client_module" in msg
    assert isinstance(ei.value, CheckpointError) and isinstance(ei.value, ImportError)

    reg.register("mem2", "unickpt.storage.memory:MemoryStorage")
    s = reg.open(f"mem2://reg-{tmp_path.name}")
    assert isinstance(s, RetryingStorage) and isinstance(s.inner, MemoryStorage)
    reg.register("broken", "unickpt.storage.memory:NoSuchFactory")
    with pytest.raises(StorageError, match="NoSuchFactory"):
        reg.open("broken://x")


def test_a4_duplicate_schemes_are_refused_and_registries_are_independent(tmp_path):
    from unickpt.storage import DEFAULT_REGISTRY, StorageRegistry

    reg = StorageRegistry()
    reg.register("x", "unickpt.storage.memory:MemoryStorage")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("x", "unickpt.storage.local:LocalStorage")
    reg.register("x", "unickpt.storage.local:LocalStorage", replace=True)
    assert isinstance(reg.open(f"x://{tmp_path}").inner, LocalStorage)
    with pytest.raises(StorageError, match=r"no storage backend for x://"):
        open_storage(f"x://{tmp_path}")  # the default registry does not know it
    assert {"file", "memory"} <= set(DEFAULT_REGISTRY.schemes())
    with pytest.raises(ValueError, match="scheme"):
        reg.register("Not A Scheme", "unickpt.storage.memory:MemoryStorage")
    unknown = StorageRegistry()
    with pytest.raises(StorageError, match=r"no storage backend for s3:// \(known: none\)"):
        unknown.open("s3://b/k")


def test_a4_open_storage_takes_frozen_options():
    from unickpt.storage import StorageOptions

    opts = StorageOptions(retry=RetryPolicy(max_attempts=2), direct_reads=True)
    with pytest.raises(AttributeError):
        opts.direct_reads = False  # type: ignore[misc]
    s = open_storage("/tmp/unickpt-a4-options", opts)
    assert isinstance(s, RetryingStorage) and s.policy.max_attempts == 2
    assert isinstance(s.inner, LocalStorage) and s.inner.direct_reads is True
    assert open_storage("file:///tmp/unickpt-a4-options").url == "/tmp/unickpt-a4-options"
