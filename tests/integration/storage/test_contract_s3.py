"""The storage contract (``contract.py``) against ``S3Storage`` on a real S3 server (SeaweedFS on
loopback, ``s3server.py``): bare, and through the retrying wrapper ``open_storage`` builds."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.fixtures.contract import StorageContract
from unickpt.storage import StorageOptions, open_storage
from unickpt.storage.base import Storage
from unickpt.storage.retry import unwrap
from unickpt.storage.s3 import S3Storage


class TestS3Contract(StorageContract):
    @pytest.fixture
    def backend(self, s3_bucket) -> Callable[[str], Storage]:
        options = StorageOptions(client_options=s3_bucket.storage_options(), part_size=5 << 20, max_concurrency=4)
        return lambda root: open_storage(f"s3://{s3_bucket.name}/{root}", options)


def test_s3_backend_is_found_by_scheme_and_states_its_capabilities(s3_bucket):
    options = StorageOptions(client_options=s3_bucket.storage_options())
    s = open_storage(f"s3://{s3_bucket.name}/ck", options)
    assert isinstance(unwrap(s), S3Storage)
    caps = s.capabilities
    assert caps.atomic_put and caps.conditional_create and not caps.atomic_rename and not caps.needs_sync
