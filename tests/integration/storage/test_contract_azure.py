"""The storage contract (``contract.py``) against ``AzureBlobStorage`` on a real Azure Blob emulator
(Azurite on loopback, ``azurite.py``), through the retrying wrapper ``open_storage``
builds; and what the emulator can express of the service's errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.fixtures.contract import StorageContract
from unickpt.storage import StorageOptions, open_storage
from unickpt.storage.base import Storage
from unickpt.storage.retry import unwrap


class TestAzureContract(StorageContract):
    @pytest.fixture
    def backend(self, az_container) -> Callable[[str], Storage]:
        options = StorageOptions(part_size=5 << 20, max_concurrency=4)
        return lambda root: open_storage(f"az://{az_container.name}/{root}", options)


def test_azure_backend_is_found_by_scheme_and_states_its_capabilities(az_container):
    from unickpt.storage.azure import AzureBlobStorage

    s = open_storage(az_container.url("ck"))
    assert isinstance(unwrap(s), AzureBlobStorage)
    caps = s.capabilities
    assert caps.atomic_put and caps.conditional_create and not caps.atomic_rename and not caps.needs_sync


def test_abfs_urls_name_the_same_blobs_with_or_without_the_account_host(az_container):
    from unickpt.storage.azure import AzureBlobStorage

    open_storage(az_container.url("ck")).put("a", b"1")
    for url in (
        f"abfs://{az_container.name}/ck",
        f"abfs://{az_container.name}@devstoreaccount1.dfs.core.windows.net/ck",
    ):
        s = open_storage(url)
        assert isinstance(unwrap(s), AzureBlobStorage) and s.url == url
        assert s.read("a") == b"1"
