"""The storage contract (``contract.py``) against in-memory storage, bare and through the
retrying wrapper ``open_storage`` puts around every backend; and against a memory-backed file
system whose rename refuses an existing target (HDFS's plain rename), which publishes by moving
the old version aside."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.fixtures.contract import NoReplaceRename, StorageContract
from unickpt.storage.base import Storage
from unickpt.storage.memory import MemoryStorage, MemoryStore
from unickpt.storage.retry import RetryingStorage, RetryPolicy


class TestMemoryContract(StorageContract):
    @pytest.fixture(params=["bare", "retrying"])
    def backend(self, request: pytest.FixtureRequest) -> Callable[[str], Storage]:
        store = MemoryStore()  # private to the test: nothing leaks between tests
        if request.param == "bare":
            return lambda root: MemoryStorage(root, store=store)
        policy = RetryPolicy(max_attempts=3, initial_delay_s=0.0)
        return lambda root: RetryingStorage(MemoryStorage(root, store=store), policy)


class TestNoReplaceRenameContract(StorageContract):
    @pytest.fixture
    def backend(self) -> Callable[[str], Storage]:
        store = MemoryStore()
        return lambda root: NoReplaceRename(root, store=store)
