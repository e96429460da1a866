"""The CheckpointError tree: every user-facing failure of unickpt is one of these.

Each subclass also inherits the matching built-in (``KeyError``, ``FileNotFoundError`` ...) so
callers that already catch built-ins keep working. Messages name the tensor, the file and the rank
wherever those are known. ``RankFailures`` aggregates errors raised on several ranks.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "NotACheckpointError",
    "IncompleteCheckpointError",
    "UnsupportedFormatVersionError",
    "CorruptMetadataError",
    "MissingKeysError",
    "UnexpectedKeysError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "MissingDataFileError",
    "TruncatedDataFileError",
    "ChecksumMismatchError",
    "StorageError",
    "TransientStorageError",
    "ConcurrentSaveError",
    "SaveLockLostError",
    "ForeignFolderError",
    "UnsafePathError",
    "SizeLimitError",
    "SnapshotConflictError",
    "FrameworkError",
    "PlanningError",
    "RankFailures",
]


class CheckpointError(Exception):
    """Root of every error unickpt raises on purpose."""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The path holds no unickpt checkpoint at all (missing, empty, or another tool's folder)."""


class IncompleteCheckpointError(CheckpointError):
    """Data files exist but the metadata (the commit marker) was never written: a save was interrupted."""


class UnsupportedFormatVersionError(CheckpointError):
    """The metadata was written by a format version this unickpt cannot read."""


class CorruptMetadataError(CheckpointError, ValueError):
    """The metadata file cannot be decoded or describes an impossible checkpoint."""


class MissingKeysError(CheckpointError, KeyError):
    """``strict=True`` load: the live state has tensors or objects the checkpoint lacks."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnexpectedKeysError(CheckpointError, KeyError):
    """``strict=True`` load: the checkpoint has entries the live state does not."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(CheckpointError, ValueError):
    """A tensor's global shape differs between the checkpoint and the live state."""


class DtypeMismatchError(CheckpointError, TypeError):
    """A tensor's dtype differs between the checkpoint and the live state."""


class MissingDataFileError(CheckpointError, FileNotFoundError):
    """A data file named by the metadata is not in storage."""


class TruncatedDataFileError(CheckpointError, EOFError):
    """A data file is shorter than the byte ranges the metadata assigns to it."""


class ChecksumMismatchError(CheckpointError, ValueError):
    """The bytes read for a shard do not match the checksum recorded at save."""


class StorageError(CheckpointError, OSError):
    """A storage operation failed (after retries where the backend retries)."""


class TransientStorageError(StorageError):
    """A storage failure worth retrying (timeouts, throttling, dropped connections, EIO).

    Backends raise it for errors they know to be transient; ``storage.retry.RetryingStorage``
    retries it with backoff and raises a plain ``StorageError`` once the retries are spent."""


class ConcurrentSaveError(CheckpointError):
    """Another job committed or is committing a checkpoint at the same path."""


class SaveLockLostError(ConcurrentSaveError):
    """This save's lock was taken over (its lease was judged expired) or its data files were
    changed while it ran: the commit is refused and nothing is published."""


class ForeignFolderError(CheckpointError, FileExistsError):
    """``save`` into a non-empty folder that is not a unickpt checkpoint (no unickpt metadata,
    lock or marker): refused before anything is written, so no file of another tool is touched."""


class UnsafePathError(StorageError):
    """A name inside a checkpoint is a symbolic link, FIFO, device or other non-regular file, or a
    file exists where unickpt creates one: unickpt never reads, writes or deletes through it."""


class SizeLimitError(CheckpointError, ValueError):
    """A file or a record is larger than the cap unickpt reads or allocates for it (the message
    names the cap and the option that raises it)."""


class SnapshotConflictError(CheckpointError):
    """A tensor an async save was still copying in the background was changed in place outside
    ``optimizer.step()``; the save is refused rather than committing a torn snapshot."""


class FrameworkError(CheckpointError, TypeError):
    """The objects in ``state`` do not fit the requested framework adapter."""


class PlanningError(CheckpointError, ValueError):
    """The shards described by the ranks cannot form a valid plan (overlap, gaps, disagreement)."""


class RankFailures(CheckpointError):
    """Errors raised on one or more ranks, gathered so every rank raises the same, complete report."""

    def __init__(self, stage: str, failures: dict[int, str]) -> None:
        self.stage = stage
        self.failures = dict(sorted(failures.items()))
        lines = [f"{stage} failed on {len(self.failures)} rank(s):"]
        lines += [f"  rank {rank}: {msg}" for rank, msg in self.failures.items()]
        super().__init__("\n".join(lines))
