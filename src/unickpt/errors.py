"""The CheckpointError tree: every user-facing failure of unickpt is one of these.

Each subclass also inherits the matching built-in (``KeyError``, ``FileNotFoundError`` ...) so
callers that already catch built-ins keep working. Family bases group them by what the caller
can do about it (catch a family rather than listing its members):

- ``IntegrityError``: the checkpoint's bytes are not what its metadata promises (corrupt
  metadata, a data file missing or short, a checksum mismatch): another copy may be good;
- ``StateMismatchError``: the checkpoint and the live state do not fit (keys, shapes, dtypes,
  per-rank state after a change of world size);
- ``CoordinationError``: the ranks did not act as one (a collective failed or timed out, they
  passed different arguments, one of them failed);
- ``ConcurrencyError``: another save, job or in-place update raced this one;
- ``ConfigurationError``: the caller's input or set-up (a state the adapter cannot take, a
  key map or shards that cannot form a plan, an unsafe name, a foreign folder, a missing extra,
  no process group, a tool's output inside its source);
- ``StorageError``: a storage operation failed (``TransientStorageError``, ``UnsafePathError``,
  ``WriterProcessError``);
- ``InternalError``: an invariant of unickpt itself failed (a bug: please report it).
``NotACheckpointError``, ``IncompleteCheckpointError``, ``UnsupportedFormatVersionError``,
``SizeLimitError`` and ``AsyncSaveFailures`` derive from ``CheckpointError`` directly.

Messages name the tensor, the file and the rank wherever those are known. ``RankFailures``
aggregates errors raised on several ranks, ``AsyncSaveFailures`` the failures of background
saves nobody has seen yet.

Errors cross process boundaries (``coordination.run_stage`` sends each rank's exception to the
others), so every class here can be rebuilt from ``pickle``'s ``(class, args, state)``: classes
with their own constructor define ``__reduce__``.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "IntegrityError",
    "StateMismatchError",
    "CoordinationError",
    "ConcurrencyError",
    "ConfigurationError",
    "InternalError",
    "NotACheckpointError",
    "IncompleteCheckpointError",
    "UnsupportedFormatVersionError",
    "CorruptMetadataError",
    "MissingKeysError",
    "UnexpectedKeysError",
    "ShapeMismatchError",
    "ResizeRefusedError",
    "DtypeMismatchError",
    "MissingDataFileError",
    "TruncatedDataFileError",
    "ChecksumMismatchError",
    "StorageError",
    "TransientStorageError",
    "WriterProcessError",
    "MissingDependencyError",
    "ConcurrentSaveError",
    "SaveLockLostError",
    "ForeignFolderError",
    "UnsafePathError",
    "SizeLimitError",
    "SnapshotConflictError",
    "FrameworkError",
    "PlanningError",
    "LoaderStateError",
    "ExtraStateResizeError",
    "StatefulListMismatchError",
    "UnsupportedValueError",
    "RankDisagreementError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "NoProcessGroupError",
    "UnsafeNameError",
    "OutputInsideSourceError",
    "RankFailures",
    "RemoteRankError",
    "AsyncSaveFailures",
]


class CheckpointError(Exception):
    """Root of every error unickpt raises on purpose."""


class IntegrityError(CheckpointError):
    """Family: the checkpoint's bytes are not what its metadata promises (``CorruptMetadataError``,
    ``MissingDataFileError``, ``TruncatedDataFileError``, ``ChecksumMismatchError``)."""


class StateMismatchError(CheckpointError):
    """Family: the checkpoint does not fit the live state (``MissingKeysError``,
    ``UnexpectedKeysError``, ``ShapeMismatchError`` and its ``ResizeRefusedError``,
    ``DtypeMismatchError``, ``LoaderStateError``, ``ExtraStateResizeError``,
    ``StatefulListMismatchError``)."""


class CoordinationError(CheckpointError):
    """Family: the ranks of one save or load did not act as one (``CollectiveError`` and
    ``CollectiveTimeoutError``, ``RankDisagreementError``, ``RankFailures``, ``RemoteRankError``)."""


class ConcurrencyError(CheckpointError):
    """Family: another save, job or in-place update raced this one (``ConcurrentSaveError``,
    ``SaveLockLostError``, ``SnapshotConflictError``)."""


class ConfigurationError(CheckpointError):
    """Family: the caller's input or set-up is wrong (``FrameworkError``, ``PlanningError``,
    ``UnsafeNameError``, ``UnsupportedValueError``, ``ForeignFolderError``,
    ``MissingDependencyError``, ``NoProcessGroupError``)."""


class InternalError(CheckpointError, RuntimeError):
    """An invariant of unickpt itself failed (e.g. a rank received another rank's part of the save
    plan): a bug in unickpt, not in the caller's input; please report it with the message."""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The path holds no unickpt checkpoint at all (missing, empty, or another tool's folder)."""


class IncompleteCheckpointError(CheckpointError):
    """Data files exist but the metadata (the commit marker) was never written: a save was interrupted."""


class UnsupportedFormatVersionError(CheckpointError):
    """The metadata was written by a format version this unickpt cannot read."""


class CorruptMetadataError(IntegrityError, ValueError):
    """The metadata file cannot be decoded or describes an impossible checkpoint."""


class MissingKeysError(StateMismatchError, KeyError):
    """``strict=True`` load: the live state has tensors or objects the checkpoint lacks."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnexpectedKeysError(StateMismatchError, KeyError):
    """``strict=True`` load: the checkpoint has entries the live state does not."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(StateMismatchError, ValueError):
    """A tensor's global shape differs between the checkpoint and the live state."""


class ResizeRefusedError(ShapeMismatchError, RuntimeError):
    """``RestoreOptions(resize_plain_tensors=True)``: a module's own ``load_state_dict`` refused a
    saved tensor of another shape (PyTorch's size-mismatch error, a ``RuntimeError``, is quoted in
    the message) or left the tensor at another shape than the saved one."""


class DtypeMismatchError(StateMismatchError, TypeError):
    """A tensor's dtype differs between the checkpoint and the live state."""


class MissingDataFileError(IntegrityError, FileNotFoundError):
    """A data file named by the metadata is not in storage."""


class TruncatedDataFileError(IntegrityError, EOFError):
    """A data file is shorter than the byte ranges the metadata assigns to it."""


class ChecksumMismatchError(IntegrityError, ValueError):
    """The bytes read for a shard do not match the checksum recorded at save."""


class StorageError(CheckpointError, OSError):
    """A storage operation failed (after retries where the backend retries)."""


class TransientStorageError(StorageError):
    """A storage failure worth retrying (timeouts, throttling, dropped connections, EIO).

    Backends raise it for errors they know to be transient; ``storage.retry.RetryingStorage``
    retries it with backoff and raises a plain ``StorageError`` once the retries are spent."""


class WriterProcessError(StorageError):
    """The writer process of an async save (``SaveOptions(writer="process")``) died or broke its
    protocol before the save's files were durable; the save is not committed."""


class MissingDependencyError(ConfigurationError, ImportError):
    """A storage backend (or another optional part) needs a library that is not installed; the
    message names the pip extra that installs it (``pip install 'unickpt[s3]'``)."""


class ConcurrentSaveError(ConcurrencyError):
    """Another job committed or is committing a checkpoint at the same path."""


class SaveLockLostError(ConcurrentSaveError):
    """This save's lock was taken over (its lease was judged expired) or its data files were
    changed while it ran: the commit is refused and nothing is published."""


class ForeignFolderError(ConfigurationError, FileExistsError):
    """``save`` into a non-empty folder that is not a unickpt checkpoint (no unickpt metadata,
    lock or marker): refused before anything is written, so no file of another tool is touched."""


class UnsafePathError(StorageError):
    """A name inside a checkpoint is a symbolic link, FIFO, device or other non-regular file, or a
    file exists where unickpt creates one: unickpt never reads, writes or deletes through it."""


class SizeLimitError(CheckpointError, ValueError):
    """A file or a record is larger than the cap unickpt reads or allocates for it (the message
    names the cap and the option that raises it)."""


class SnapshotConflictError(ConcurrencyError):
    """A tensor an async save was still copying in the background was changed in place outside
    ``optimizer.step()``; the save is refused rather than committing a torn snapshot."""


class FrameworkError(ConfigurationError, TypeError):
    """The objects in ``state`` do not fit the requested framework adapter."""


class PlanningError(ConfigurationError, ValueError):
    """The shards described by the ranks cannot form a valid plan (overlap, gaps, disagreement)."""


class LoaderStateError(StateMismatchError, ValueError):
    """Dataloader state that cannot be restored without losing or repeating data: per-rank state of
    a loader without the ``unickpt.data`` protocol after a change of world size, or parts that
    the loader cannot take (another part count, more DP ranks than parts)."""


class StatefulListMismatchError(StateMismatchError, ValueError):
    """A list of ``Stateful`` objects under one key does not fit the checkpoint's: another length,
    or one object saved where the live state has a list (or the reverse)."""


class ExtraStateResizeError(StateMismatchError, ValueError):
    """Per-rank ``extra_state`` saved at another world size, with
    ``LoadOptions(restore=RestoreOptions(extra_state_on_resize="error"))``."""


class UnsupportedValueError(ConfigurationError, TypeError):
    """A value in ``extra_state`` / dataloader state that unickpt cannot save safely (an arbitrary
    object, a numpy object array ...): the message names where it is in the state."""


class RankDisagreementError(CoordinationError, ValueError):
    """The ranks of one save/load passed different destinations, frameworks or roles (e.g. a
    per-rank timestamp in the path). Raised on every rank before anything is written; the
    message lists each rank's value. ``values``: what differs -> {rank: value as text}."""

    def __init__(self, message: str, values: dict[str, dict[int, str]] | None = None) -> None:
        super().__init__(message)
        self.values = dict(values or {})

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.values), self.__dict__)


class CollectiveError(CoordinationError, RuntimeError):
    """A collective on unickpt's process groups failed: a peer left or died, or the group was
    destroyed (``torch.distributed.destroy_process_group()`` while a save was still running).
    ``missing_ranks``: the ranks (of the checkpoint group) that had not arrived at it."""

    def __init__(self, message: str, missing_ranks: tuple[int, ...] = (), timeout_s: float | None = None) -> None:
        super().__init__(message)
        self.missing_ranks = tuple(missing_ranks)
        self.timeout_s = timeout_s

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.missing_ranks, self.timeout_s), self.__dict__)


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within the timeout (the job's ``init_process_group``
    timeout, or ``SaveOptions.timeout`` / ``LoadOptions.timeout``): ``missing_ranks`` did not
    call the same unickpt save/load (or are still busy before it)."""


class UnsafeNameError(ConfigurationError, ValueError):
    """A tensor, blob or ``extra_state`` key name holds a control character, NUL or invisible
    format character (bidi marks ...): refused at save, before anything is written."""


class OutputInsideSourceError(ConfigurationError, ValueError):
    """A tool that writes a new folder (``merge``, ``convert``, ``modify``) was given an output
    inside its source checkpoint, or a source inside its output (paths resolved): refused before
    anything is read or written, since writing would change the source."""


class NoProcessGroupError(ConfigurationError, RuntimeError):
    """A save or load in one of several launched ranks (``WORLD_SIZE`` > 1, as ``torchrun`` sets)
    before ``torch.distributed.init_process_group``: each rank would act alone on one folder."""


class RankFailures(CoordinationError):
    """Errors raised on one or more ranks, gathered so every rank raises the same, complete report.

    ``failures``: rank -> the exception that rank raised (this rank's own object; other ranks'
    rebuilt with their attributes, e.g. an ``OSError``'s ``errno``, or a ``RemoteRankError``
    when their type cannot be rebuilt here). ``messages``: rank -> ``"Type: message"``."""

    def __init__(self, stage: str, failures: dict[int, BaseException]) -> None:
        self.stage = stage
        self.failures = dict(sorted(failures.items()))
        lines = [f"{stage} failed on {len(self.failures)} rank(s):"]
        lines += [f"  rank {rank}: {msg}" for rank, msg in self.messages.items()]
        super().__init__("\n".join(lines))

    @property
    def messages(self) -> dict[int, str]:
        return {rank: describe_exception(e) for rank, e in self.failures.items()}

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.stage, self.failures), {k: v for k, v in self.__dict__.items() if k != "failures"})


class RemoteRankError(CoordinationError):
    """Stands for an exception raised on another rank whose type could not be rebuilt here:
    ``type_name``, its message and ``traceback_text`` (formatted on the rank that raised it)."""

    def __init__(self, type_name: str, message: str, traceback_text: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.type_name, self.message, self.traceback_text), self.__dict__)


class AsyncSaveFailures(CheckpointError):
    """Asynchronous saves that failed while nobody was waiting on them, reported together by the
    next save/load, ``unickpt.wait_all()``, ``CheckpointManager.wait()`` or at exit.

    ``failures``: ``(path, exception)`` per failed save, oldest first; the first exception is
    also the ``__cause__``."""

    def __init__(self, failures: list[tuple[str, BaseException]], what: str = "") -> None:
        self.failures = list(failures)
        self.what = what
        n = len(self.failures)
        head = f"{'a' if n == 1 else n} previous asynchronous save{'s' if n > 1 else ''}{what} failed"
        lines = [f"  {path}: {describe_exception(e)}" for path, e in self.failures]
        super().__init__(head + ":\n" + "\n".join(lines))
        if self.failures:
            self.__cause__ = self.failures[0][1]

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.failures, self.what), {k: v for k, v in self.__dict__.items() if k != "failures"})


def describe_exception(e: BaseException) -> str:
    """``"Type: message"`` for reports (CheckpointErrors and remote stand-ins: the message)."""
    if isinstance(e, RemoteRankError):
        return str(e)
    return f"{type(e).__name__}: {e}"
