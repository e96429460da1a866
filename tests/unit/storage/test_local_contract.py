"""The storage contract (``contract.py``) against local files, with buffered and direct I/O."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from tests.fixtures.contract import StorageContract
from unickpt.storage import StorageOptions
from unickpt.storage.base import Storage
from unickpt.storage.local import LocalStorage


class TestLocalContract(StorageContract):
    @pytest.fixture(params=["buffered", "direct"])
    def backend(self, request: pytest.FixtureRequest, tmp_path) -> Callable[[str], Storage]:
        direct = request.param == "direct"
        options = StorageOptions(direct_writes=direct, direct_reads=direct)
        return lambda root: LocalStorage(str(tmp_path / "roots" / root), options)

    @pytest.fixture
    def make_link(self) -> Callable[[Storage, str, str], None]:
        def make(storage: Storage, name: str, target: str) -> None:
            path = os.path.join(storage.url, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.symlink(target, path)

        return make
