"""Retries with exponential backoff and jitter around any storage backend.

``open_storage`` wraps every backend it builds: ``RetryingStorage(backend, RetryPolicy())``. The
engine then calls the storage protocol as usual (``write`` per data file on every rank, ``commit``
of the metadata on rank 0, ``size`` / ``read_into`` on load ...); each call is attempted up to
``policy.max_attempts`` times, for at most ``policy.max_elapsed_s`` seconds, when it fails with a
*transient* error:

- ``TransientStorageError`` (raised by backends that know an error is transient: throttling,
  timeouts of an object store);
- any ``OSError`` whose errno is one of ``TRANSIENT_ERRNOS`` (EIO, EAGAIN, EINTR, ETIMEDOUT,
  ECONNRESET, EBUSY), including ``StorageError``s that carry such an errno;
- ``TimeoutError`` / ``ConnectionResetError`` / ``InterruptedError`` / ``BlockingIOError``
  raised without an errno (Python-level timeouts in client libraries).

Everything else is permanent and fails at once: ENOSPC ("disk full"), EACCES, EROFS, ENOENT on a
write, missing or truncated data files (``MissingDataFileError`` / ``TruncatedDataFileError``) ...
Every error that leaves this wrapper is a ``StorageError`` (or the backend's own, more precise
``CheckpointError``) whose message names the operation and the file; the engine adds the rank and
the stage (``coordination.run_stage`` -> ``RankFailures``).

All protocol operations can be repeated after a partial failure (``write`` removes its partial
file before it raises, so its exclusive create succeeds again; ``delete`` ignores missing names;
``commit`` republishes the same bytes).
Optional backend methods (``sync_dir``) are retried too; other attributes are forwarded as is
(``create_exclusive`` / ``update_exclusive`` of the save lock are not retried: a repeat after a
failure that did take effect would misread the lock's state).
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import CheckpointError, StorageError, TransientStorageError
from .base import METADATA_LIMIT, Buffer, Storage

__all__ = ["RetryPolicy", "RetryingStorage", "NO_RETRY", "TRANSIENT_ERRNOS", "is_transient", "with_retries", "unwrap"]

T = TypeVar("T")

TRANSIENT_ERRNOS: frozenset[int] = frozenset(
    {errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET, errno.EBUSY}
)
_TRANSIENT_TYPES = (TimeoutError, ConnectionResetError, InterruptedError, BlockingIOError)
_RETRIED_OPTIONAL = frozenset({"sync_dir", "read_into_cached"})


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How transient storage errors are retried.

    Attempt ``k`` (1-based) that fails is followed by a sleep of
    ``min(max_delay_s, initial_delay_s * multiplier**(k-1))`` scaled by a random factor in
    ``[1 - jitter, 1 + jitter]``; no attempt starts after ``max_elapsed_s``."""

    max_attempts: int = 5
    initial_delay_s: float = 0.05
    multiplier: float = 2.0
    max_delay_s: float = 2.0
    jitter: float = 0.5
    max_elapsed_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_delay_s < 0 or self.max_delay_s < 0 or self.max_elapsed_s < 0:
            raise ValueError("RetryPolicy delays must be >= 0")
        if self.multiplier < 1:
            raise ValueError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (1-based)."""
        base = min(self.max_delay_s, self.initial_delay_s * self.multiplier ** (attempt - 1))
        u = (rng or random).random()
        return max(0.0, base * (1.0 + self.jitter * (2.0 * u - 1.0)))


NO_RETRY = RetryPolicy(max_attempts=1)


def is_transient(e: BaseException) -> bool:
    """Whether ``e`` is worth retrying (see the module docstring)."""
    if isinstance(e, TransientStorageError):
        return True
    if not isinstance(e, OSError):
        return False
    if e.errno is not None:
        return e.errno in TRANSIENT_ERRNOS
    return isinstance(e, _TRANSIENT_TYPES) and not isinstance(e, CheckpointError)


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"[Errno {e.errno}] {e.strerror}" if e.errno is not None else str(e.strerror)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _error(code: int | None, message: str) -> StorageError:
    return StorageError(code, message) if code is not None else StorageError(message)


def with_retries(
    op: str, target: str, fn: Callable[[], T], policy: RetryPolicy, sleep: Callable[[float], None] = time.sleep
) -> T:
    """Call ``fn`` under ``policy``; ``op`` and ``target`` (the file) name it in errors."""
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                if isinstance(e, CheckpointError):
                    raise  # already precise (StorageError naming the file, MissingDataFile...)
                code = e.errno if isinstance(e, OSError) else None
                hint = " (disk full)" if code in (errno.ENOSPC, errno.EDQUOT) else ""
                raise _error(code, f"{op} {target} failed{hint}: {_describe(e)}") from e
            pause = policy.delay(attempt)
            elapsed = time.monotonic() - start
            if attempt >= policy.max_attempts or elapsed + pause > policy.max_elapsed_s:
                code = e.errno if isinstance(e, OSError) else None
                raise _error(
                    code,
                    f"{op} {target} failed after {attempt} attempt(s) over {elapsed:.2f}s "
                    f"(transient error, retries exhausted): {_describe(e)}",
                ) from e
            sleep(pause)


class RetryingStorage:
    """A ``Storage`` that retries transient failures of ``inner`` under ``policy``."""

    def __init__(
        self, inner: Storage, policy: RetryPolicy | None = None, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.policy = policy or RetryPolicy()
        self._sleep = sleep

    def _run(self, op: str, name: str, fn: Callable[[], T]) -> T:
        return with_retries(op, f"{self.inner.url}/{name}", fn, self.policy, self._sleep)

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        self._run("write", name, lambda: self.inner.write(name, parts))

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._run("read", name, lambda: self.inner.read_into(name, offset, out))

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        return self._run("read", name, lambda: self.inner.read(name, limit))

    def size(self, name: str) -> int | None:
        return self._run("stat", name, lambda: self.inner.size(name))

    def list(self, prefix: str = "") -> list[str]:
        return self._run("list", prefix + "*", lambda: self.inner.list(prefix))

    def delete(self, names: Sequence[str]) -> None:
        names = list(names)
        target = names[0] if len(names) == 1 else f"{{{len(names)} files}}"
        self._run("delete", target, lambda: self.inner.delete(names))

    def commit(self, name: str, data: bytes) -> None:
        self._run("commit", name, lambda: self.inner.commit(name, data))

    def __getattr__(self, attr: str) -> Any:
        # only called for attributes not defined above: optional backend methods and fields
        if attr == "inner":  # not yet set (e.g. during unpickling): avoid infinite recursion
            raise AttributeError(attr)
        value = getattr(self.inner, attr)
        if attr in _RETRIED_OPTIONAL and callable(value):

            def retried(name: str = "", *args: Any, **kwargs: Any) -> Any:
                return self._run(attr, name or ".", lambda: value(name, *args, **kwargs))

            return retried
        return value

    def __repr__(self) -> str:
        return f"RetryingStorage({self.inner!r}, {self.policy!r})"


def unwrap(storage: Any) -> Any:
    """The innermost backend under any number of ``RetryingStorage`` layers."""
    while isinstance(storage, RetryingStorage):
        storage = storage.inner
    return storage
