"""``StorageOptions``: how ``open_storage`` builds a backend (a small frozen record).

Given to ``open_storage(url, options)`` (``SaveOptions.storage`` / ``LoadOptions.storage`` for
``unickpt.save`` / ``load``); every registered factory receives it with the path. Fields a
backend does not use are ignored by it. Environment variables are only *defaults*, read when a
backend is created (never at import): ``UNICKPT_DIRECT_IO=0`` turns direct writes off,
``UNICKPT_DIRECT_READS=1`` turns direct reads on, where the field is left at None. Object
stores take their endpoint and credentials from ``client_options`` (``s3fs.S3FileSystem``
keyword arguments: ``endpoint_url``, ``key``, ``secret``, ``client_kwargs={"region_name": ...}``),
else from the standard variables ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION`` that their client reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .retry import RetryPolicy

__all__ = ["StorageOptions", "DIRECT_WRITES_ENV", "DIRECT_READS_ENV"]

DIRECT_WRITES_ENV = "UNICKPT_DIRECT_IO"  # "0": buffered writes (default: direct)
DIRECT_READS_ENV = "UNICKPT_DIRECT_READS"  # "1": direct reads of >= 1 MiB (default: buffered)


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageOptions:
    # transient storage errors are retried with backoff under this policy (storage.retry)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # local files: O_DIRECT writes of files >= 1 MiB (no page-cache copy, little CPU for a
    # background save). None: on unless $UNICKPT_DIRECT_IO is "0" when the backend is created
    direct_writes: bool | None = None
    # local files: O_DIRECT reads of ranges >= 1 MiB (bytes several ranks of a host read still go
    # through the page cache). None: off unless $UNICKPT_DIRECT_READS is "1" at creation
    direct_reads: bool | None = None
    # object stores / remote file systems: keyword arguments of their client (s3fs, hdfs-native),
    # e.g. {"endpoint_url": ..., "key": ..., "secret": ...}; empty: the client's own defaults
    client_options: Mapping[str, Any] = field(default_factory=dict)
    # object stores: data files larger than this are uploaded as parts of this size in parallel
    # (S3: >= 5 MiB); ranged reads are cut into requests of this size
    part_size: int = 32 << 20
    # object stores: requests in flight at once per process (uploads of parts, ranged reads)
    max_concurrency: int = 16

    def __post_init__(self) -> None:
        if self.part_size < (5 << 20):
            raise ValueError(f"StorageOptions.part_size must be >= 5 MiB (S3's smallest part), got {self.part_size}")
        if self.max_concurrency < 1:
            raise ValueError(f"StorageOptions.max_concurrency must be >= 1, got {self.max_concurrency}")

    def resolved_direct_writes(self) -> bool:
        """``direct_writes``, or its environment default now."""
        if self.direct_writes is not None:
            return self.direct_writes
        return os.environ.get(DIRECT_WRITES_ENV, "1") != "0"

    def resolved_direct_reads(self) -> bool:
        """``direct_reads``, or its environment default now."""
        if self.direct_reads is not None:
            return self.direct_reads
        return os.environ.get(DIRECT_READS_ENV, "0") == "1"
