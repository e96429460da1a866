"""The storage contract (``contract.py``) against ``GcsStorage`` on a real GCS emulator
(fake-gcs-server on loopback, ``gcsserver.py``), through the retrying wrapper ``open_storage``
builds; and what the emulator can express of the service's errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.fixtures.contract import StorageContract
from unickpt.storage import StorageOptions, open_storage
from unickpt.storage.base import Storage
from unickpt.storage.retry import unwrap


class TestGcsContract(StorageContract):
    @pytest.fixture
    def backend(self, gcs_bucket) -> Callable[[str], Storage]:
        options = StorageOptions(part_size=5 << 20, max_concurrency=4)
        return lambda root: open_storage(f"gs://{gcs_bucket.name}/{root}", options)


def test_gcs_backend_is_found_by_scheme_and_states_its_capabilities(gcs_bucket):
    from unickpt.storage.gcs import GcsStorage

    s = open_storage(gcs_bucket.url("ck"))
    assert isinstance(unwrap(s), GcsStorage)
    caps = s.capabilities
    assert caps.atomic_put and caps.conditional_create and not caps.atomic_rename and not caps.needs_sync
