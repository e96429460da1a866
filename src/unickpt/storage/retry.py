"""Retries with exponential backoff and jitter around any storage backend.

``open_storage`` wraps every backend it builds: ``RetryingStorage(backend, options.retry)``. The
engine then calls the storage protocol as usual (``write`` per data file on every rank, the
metadata's publication on rank 0, ``size`` / ``read_into`` on load ...); each call is attempted up to
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

``RetryingStorage`` implements the storage protocol method by method (nothing else is forwarded)
with one idempotency decision each, for a failure whose effect is unknown (a timeout after the
request left, a lost reply):

- repeated as they are: ``read``, ``read_into``, ``read_into_cached``, ``size``, ``list``
  (reads), ``delete`` (missing names are ignored), ``put`` (the same bytes again), ``sync``;
- ``write`` (exclusive): repeated; when the repeat finds the name taken after an earlier failed
  attempt, the object is read back and compared with the parts: ours (the earlier attempt landed,
  its reply was lost) is success, anything else stays the ``exists`` error;
- ``create_exclusive``: repeated; False after an earlier failed attempt is turned into True only
  when the object holds exactly our bytes (callers put a unique token in them: lock owners,
  markers), so "my earlier attempt succeeded" is told apart from "someone else holds it";
- ``update_exclusive`` (compare-and-swap): before a repeat the object is read: our new bytes ->
  True (it landed), the expected bytes -> try again, anything else (gone, another writer) -> False;
- ``rename``: before a repeat the source is looked up: gone while the target exists -> the earlier
  attempt moved it (success, never renamed twice); still there -> try again.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import CheckpointError, SizeLimitError, StorageError, TransientStorageError
from .base import METADATA_LIMIT, Buffer, Storage, StorageCapabilities, is_exists_error

__all__ = [
    "RetryPolicy",
    "RetryingStorage",
    "NO_RETRY",
    "TRANSIENT_ERRNOS",
    "is_transient",
    "with_retries",
    "with_attempts",
    "unwrap",
]

T = TypeVar("T")

TRANSIENT_ERRNOS: frozenset[int] = frozenset(
    {errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET, errno.EBUSY}
)
_TRANSIENT_TYPES = (TimeoutError, ConnectionResetError, InterruptedError, BlockingIOError)
_COMPARE_CHUNK = 8 << 20  # read-back of a written object after a lost reply, in chunks of this size


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
    return with_attempts(op, target, lambda _attempt: fn(), policy, sleep)


OnRetry = Callable[[str, str, int, BaseException, float], None]  # op, target, failed attempt, error, pause


def with_attempts(
    op: str,
    target: str,
    fn: Callable[[int], T],
    policy: RetryPolicy,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: OnRetry | None = None,
) -> T:
    """``with_retries`` for steps that are not blindly repeatable: ``fn(attempt)`` gets the
    attempt number (1-based), so a repeat can first check what the failed attempt left.
    ``on_retry`` hears of every transient failure that is retried (monitoring)."""
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn(attempt)
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
            if on_retry is not None:
                try:
                    on_retry(op, target, attempt, e, pause)
                except Exception:  # monitoring never changes the outcome
                    pass
            sleep(pause)


class RetryingStorage:
    """A ``Storage`` that retries transient failures of ``inner`` under ``policy`` (see the
    module docstring for the decision made for each method)."""

    def __init__(
        self, inner: Storage, policy: RetryPolicy | None = None, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.inner = inner
        self.url: str = inner.url
        self.capabilities: StorageCapabilities = inner.capabilities
        self.policy = policy or RetryPolicy()
        self._sleep = sleep
        # called for each retried transient failure (the checkpointer emits ``storage.retry``)
        self.on_retry: OnRetry | None = None

    def __repr__(self) -> str:
        return f"RetryingStorage({self.inner!r}, {self.policy!r})"

    def _run(self, op: str, name: str, fn: Callable[[int], T]) -> T:
        return with_attempts(op, f"{self.inner.url}/{name}", fn, self.policy, self._sleep, self.on_retry)

    # ------------------------------------------------------------------ repeatable as they are

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._run("read", name, lambda _: self.inner.read_into(name, offset, out))

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        self._run("read", name, lambda _: self.inner.read_into_cached(name, offset, out))

    def read(self, name: str, limit: int = METADATA_LIMIT) -> bytes | None:
        return self._run("read", name, lambda _: self.inner.read(name, limit))

    def size(self, name: str) -> int | None:
        return self._run("stat", name, lambda _: self.inner.size(name))

    def list(self, prefix: str = "") -> list[str]:
        return self._run("list", prefix + "*", lambda _: self.inner.list(prefix))

    def delete(self, names: Sequence[str]) -> None:
        names = list(names)
        if not names:
            return
        target = names[0] if len(names) == 1 else f"{{{len(names)} files}}"
        self._run("delete", target, lambda _: self.inner.delete(names))

    def put(self, name: str, data: bytes) -> None:
        self._run("put", name, lambda _: self.inner.put(name, data))

    def sync(self, folder: str = "") -> None:
        self._run("sync", folder or ".", lambda _: self.inner.sync(folder))

    # ------------------------------------------------------------------ checked before a repeat

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        parts = list(parts)

        def attempt(n: int) -> None:
            try:
                self.inner.write(name, parts)
            except Exception as e:
                if n > 1 and is_exists_error(e) and self._holds(name, parts):
                    return  # an earlier attempt landed; only its reply was lost
                raise

        self._run("write", name, attempt)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        def attempt(n: int) -> bool:
            if self.inner.create_exclusive(name, data):
                return True
            return n > 1 and self._read_small(name, len(data)) == bytes(data)

        return self._run("create", name, attempt)

    def update_exclusive(self, name: str, expected: bytes, data: bytes) -> bool:
        def attempt(n: int) -> bool:
            if n > 1:
                current = self._read_small(name, max(len(data), len(expected)))
                if current == bytes(data):
                    return True  # the failed attempt did swap
                if current != bytes(expected):
                    return False  # gone, or another writer's bytes
            return self.inner.update_exclusive(name, expected, data)

        return self._run("update", name, attempt)

    def rename(self, src: str, dst: str) -> None:
        def attempt(n: int) -> None:
            if n > 1 and self.inner.size(src) is None:
                if self.inner.size(dst) is not None:
                    return  # the failed attempt moved it: never rename twice
                raise StorageError(
                    errno.ENOENT, f"rename {self.inner.url}/{src} -> {dst}: the source vanished after a failed attempt"
                )
            self.inner.rename(src, dst)

        self._run("rename", f"{src} -> {dst}", attempt)

    def _read_small(self, name: str, limit: int) -> bytes | None:
        """``name``'s bytes if it holds at most ``limit`` (else, or missing, None)."""
        try:
            return self.inner.read(name, limit)
        except SizeLimitError:
            return None

    def _holds(self, name: str, parts: Sequence[Buffer]) -> bool:
        """Whether ``name`` holds exactly the concatenation of ``parts`` (read back in chunks)."""
        views = [memoryview(p).cast("B") for p in parts]
        if self.inner.size(name) != sum(len(v) for v in views):
            return False
        buf = bytearray(min(_COMPARE_CHUNK, max(1, max((len(v) for v in views), default=1))))
        pos = 0
        for v in views:
            for lo in range(0, len(v), len(buf)):
                piece = v[lo : lo + len(buf)]
                out = memoryview(buf)[: len(piece)]
                self.inner.read_into(name, pos, out)
                if out != piece:
                    return False
                pos += len(piece)
        return True


def unwrap(storage: Any) -> Any:
    """The innermost backend under any number of ``RetryingStorage`` layers."""
    while isinstance(storage, RetryingStorage):
        storage = storage.inner
    return storage
