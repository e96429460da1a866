"""``StorageOptions``: how ``open_storage`` builds a backend (a small frozen record).

Given to ``open_storage(url, options)`` (``SaveOptions.storage`` / ``LoadOptions.storage`` for
``unickpt.save`` / ``load``); every registered factory receives it with the path. Fields a
backend does not use are ignored by it. Environment variables are only *defaults*, read when a
backend is created (never at import): ``UNICKPT_DIRECT_IO=0`` turns direct writes off,
``UNICKPT_DIRECT_READS=1`` turns direct reads on, where the field is left at None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

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
