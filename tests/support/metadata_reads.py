"""A local storage that records each read of a checkpoint's metadata file: tests that a load
reads the metadata once register it under a scheme of their own and load from ``scheme://path``."""

from __future__ import annotations

from unickpt.format import METADATA_FILE
from unickpt.storage import register_storage
from unickpt.storage.base import METADATA_LIMIT
from unickpt.storage.local import LocalStorage


def count_metadata_reads(scheme: str) -> list[str]:
    """Register ``scheme`` as local storage that appends ``METADATA_FILE`` to the returned list on
    each read of it."""
    reads: list[str] = []

    class CountsMetadataReads(LocalStorage):
        def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
            if name == METADATA_FILE:
                reads.append(name)
            return super().read(name, limit)

    register_storage(scheme, CountsMetadataReads, replace=True)
    return reads
