"""One save at a time per checkpoint path: the save lock, and cleanup after a failed save.

Order of use. A save (every rank) snapshots, then hands its write + commit to the save worker
wrapped in ``run_locked(background_coord, storage, rank_plan, body)``,
which on every rank, in the worker thread, before any data byte is written:
  1. ``acquire_save_lock`` — collective. Rank 0 (``prepare_save``) checks that the folder is
     unickpt's (``markers.check_save_folder``), takes the lock (``try_acquire``) and writes the
     save's data marker (``markers.mark_save``), then broadcasts the outcome: on any refusal
     *every* rank raises the same error type (``ConcurrentSaveError`` naming the holder,
     ``ForeignFolderError`` ...), so no rank is left waiting in a collective.
  2. ``body(lock)``: the writes and the commit (``engine.save.write``, ``engine.save.commit``).
     Right before publishing, rank 0 checks every data file and calls ``lock.verify_holder()``;
     after the commit it removes stale data (``folder.cleanup.remove_stale_data``) *while still
     holding the lock*.
  3. on failure, ``discard_partial_save`` (every rank, best effort) deletes this save's own data
     files, unless the metadata already names this save — a full disk gets its space back.
  4. ``SaveLock.release()`` — rank 0, after the commit or the failure.
``CheckpointManager`` retention asks ``lock_is_live`` (``folder.cleanup``) before deleting an incomplete folder.

The lock. Lock files are *generations* ``unickpt.save.lock.<n>``, n >= 1
(``markers.lock_generation``): the holder is the record in the highest generation. Any other
name, a bare ``unickpt.save.lock`` included, is not a lock: never read, never deleted (a folder
holding nothing else is foreign, ``markers.check_save_folder``). Taking a free lock creates
generation 1 with O_CREAT|O_EXCL; breaking a stale generation ``g`` is one exclusive create of
``g+1``: of several breakers exactly one succeeds, the others find ``g+1`` taken and look again.
The winner then checks that ``g`` still holds the bytes it judged stale (else its view was old —
``g`` was renewed, or broken, used and released by others meanwhile — and it withdraws), and
removes the generations below its own. Release deletes the holder's own generation. No step ever
leaves the lock name empty while it is held.

The holder record (``lock_owner.LockOwner``) names the save, host, pid and process start time, a
random token (this acquisition), the host's boot id, the holder's PID-namespace inode and a
lease; a record that lacks any of them, or whose lease is not positive, is invalid
(``lock_owner.record_problem``) and treated as unreadable: not live, broken with a warning
naming the problem. Rank 0 runs a heartbeat thread that renews the record every ``lease_s / 6``
seconds (``SaveLock.renew``, an in-place rewrite that never recreates a file that is gone). A
lock is *stale* (``lock_owner.stale_reason``) when its heartbeat is older than its lease, on any
host; or — only when it was taken in this very boot and PID namespace of this host, where its
pid means what it says — when its process is gone, its pid was reused, or it is this process's
own leaked lock. A live job in another container (same host name, pid 1 in both) is never judged
by pid. Clocks of the hosts sharing a folder must agree to well within a lease (NTP does).

Storage operations (all declared in ``storage.base``): generations are created through the
publisher (``folder.publish``: ``create_exclusive``, or a temporary renamed into place where a
rename cannot replace), renewed with ``update_exclusive`` (compare-and-swap), found with
``list``, read with ``read``, removed with ``delete``.

Limitations: on a backend whose exclusive create is exact only within one process
(``StorageCapabilities.conditional_create`` False) the lock does not exclude other jobs. A
breaker that stalls longer than a whole save of another job may, when it wakes, make a third
job's commit refuse itself (its ``verify_holder`` sees a generation above its own for
the instant before the breaker withdraws): a failed save, never two commits. A commit that
itself stalls longer than the lease could be overtaken; leases far longer than storage stalls
(the default 60 s) make that negligible.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from ..coordination.base import Coordinator
from ..coordination.outcomes import retitled
from ..errors import (
    CheckpointError,
    ConcurrentSaveError,
    ForeignFolderError,
    SaveLockLostError,
    SizeLimitError,
    StorageError,
    UnsafePathError,
)
from ..storage.base import SMALL_FILE_LIMIT, Storage
from .lock_owner import DEFAULT_LEASE_S, LockContext, LockOwner, record_problem, stale_reason
from .markers import LOCK_FILE, check_save_folder, delete_save_data, lock_generation, mark_save, marker_name
from .probe import committed_save_id
from .publish import publisher_for

if TYPE_CHECKING:
    from ..planning.save.model import RankSavePlan

__all__ = [
    "LOCK_FILE",
    "DEFAULT_LEASE_S",
    "LockOwner",
    "SaveLock",
    "acquire_save_lock",
    "prepare_save",
    "try_acquire",
    "lock_generations",
    "read_lock_owner",
    "lock_is_live",
    "stale_reason",
    "discard_partial_save",
    "run_locked",
    "checkpoint_replaced",
]

T = TypeVar("T")

_BEATS_PER_LEASE = 6
_LEASE_RANGE = (1.0, 86400.0)
_ATTEMPTS = 8
_UNREADABLE_GRACE_S = 0.5


def _gen_name(gen: int, prefix: str = "") -> str:
    return f"{prefix}{LOCK_FILE}.{gen}"


def lock_generations(storage: Storage, prefix: str = "") -> list[int]:
    """The generations of lock files at ``prefix`` (a folder inside ``storage``, '' or 'a/b/'),
    sorted (``markers.lock_generation``: other names are not lock files)."""
    gens = (lock_generation(name[len(prefix) :]) for name in storage.list(prefix + LOCK_FILE))
    return sorted(g for g in gens if g is not None)


def read_lock_owner(storage: Storage, prefix: str = "") -> tuple[bytes, LockOwner | None] | None:
    """The raw bytes and decoded owner of the current lock (highest generation; the owner is None
    when the record is invalid), or None when the lock is free. Raises ``UnsafePathError`` /
    ``SizeLimitError`` for a lock file that is not a small regular file."""
    gens = lock_generations(storage, prefix)
    if not gens:
        return None
    data = storage.read(_gen_name(gens[-1], prefix), SMALL_FILE_LIMIT)
    return None if data is None else (data, LockOwner.decode(data))


def lock_is_live(storage: Storage, prefix: str = "", ctx: LockContext | None = None) -> bool:
    """Whether a save may still be running under the lock at ``prefix`` (for retention)."""
    found = read_lock_owner(storage, prefix)
    held = ctx.held_here if ctx is not None else None
    return found is not None and found[1] is not None and stale_reason(found[1], held_here=held) is None


class SaveLock:
    """This rank's part of a save lock. Only rank 0's (``owner`` set) holds a lock file; it
    renews it from a heartbeat thread until ``release``. Methods are no-ops on other ranks."""

    def __init__(
        self,
        storage: Storage,
        owner: LockOwner | None,
        name: str = "",
        data: bytes = b"",
        ctx: LockContext | None = None,
    ) -> None:
        self.storage, self.owner, self.name = storage, owner, name
        self._ctx = ctx or LockContext()
        self._data = data  # the bytes the lock file holds now
        self._mutex = threading.Lock()
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"SaveLock({self.storage.url}/{self.name or '-'}, owner={self.owner!r})"

    def _start_heartbeat(self) -> None:
        assert self.owner is not None
        self._thread = threading.Thread(
            target=self._beat, args=(self.owner.lease_s / _BEATS_PER_LEASE,), name="unickpt-lock-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.renew()
            except SaveLockLostError:
                return
            except Exception:  # a storage hiccup: the next beat (or the commit's check) retries
                continue

    def _lost_error(self, why: str) -> SaveLockLostError:
        assert self.owner is not None
        self._lost = self._lost or why
        return SaveLockLostError(
            f"save {self.owner.save_id} lost its save lock at {self.storage.url}: {self._lost} (another "
            "job judged its lease expired and took the lock); refusing to commit, nothing was published"
        )

    def renew(self) -> None:
        """Rewrite the record with a fresh heartbeat; ``SaveLockLostError`` if it is no longer
        this lock's (broken by another job, which judged it stale)."""
        if self.owner is None:
            return
        with self._mutex:
            if self._lost is not None:
                raise self._lost_error(self._lost)
            data = replace(self.owner, renewed_unix=time.time()).encode()
            # never shorter than the record it replaces (JSON allows trailing blanks): the in-place
            # rewrite then never leaves a reader the old record's tail before it is cut off
            data = data.ljust(len(self._data))
            if not self.storage.update_exclusive(self.name, self._data, data):
                raise self._lost_error(f"{self.name} was replaced or removed")
            self._data = data

    def verify_holder(self) -> None:
        """Rank 0, right before the commit: renew the lease and check that no newer generation
        exists, so this save still holds the lock for a whole lease; else ``SaveLockLostError``."""
        if self.owner is None:
            return
        self.renew()
        mine = lock_generation(self.name) or 0
        newer = [g for g in lock_generations(self.storage) if g > mine]
        if newer:
            with self._mutex:
                raise self._lost_error(f"a newer lock generation {_gen_name(newer[-1])} exists")

    def release(self) -> None:
        """Delete the lock file if it is still ours (rank 0; no-op elsewhere). Never raises: a
        lock that cannot be removed is broken later as a leaked lock, with a warning."""
        if self.owner is None:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._ctx.tokens.drop(self.owner.token)
        try:
            current = self.storage.read(self.name, SMALL_FILE_LIMIT)
            holder = read_lock_owner(self.storage)
            if current == self._data:
                self.storage.delete([self.name])
            elif holder is not None and holder[1] != self.owner:
                warnings.warn(
                    f"save lock {self.storage.url}/{self.name} was taken over by "
                    f"another job while {self.owner.save_id} ran; leaving it",
                    stacklevel=2,
                )
        except CheckpointError as e:
            warnings.warn(f"could not release save lock {self.storage.url}/{self.name}: {e}", stacklevel=2)


def try_acquire(
    storage: Storage, save_id: str, lease_s: float = DEFAULT_LEASE_S, ctx: LockContext | None = None
) -> SaveLock:
    """One process: take the save lock of ``storage`` for ``save_id`` or raise
    ``ConcurrentSaveError`` naming the holder. Stale locks are broken with a warning. The lock
    is renewed by a heartbeat thread until ``release()``. ``ctx``: the calling checkpointer's
    lock tokens (default: a context of its own)."""
    ctx = ctx or LockContext()
    if not _LEASE_RANGE[0] <= lease_s <= _LEASE_RANGE[1]:
        raise ValueError(f"lease_s must be in [{_LEASE_RANGE[0]}, {_LEASE_RANGE[1]}] seconds, got {lease_s}")
    owner = LockOwner.for_this_process(save_id, lease_s)
    data = owner.encode()
    ctx.tokens.hold(owner.token)  # before the file exists: a reader in this process must see it as live
    try:
        for _attempt in range(_ATTEMPTS):
            lock = _attempt_once(storage, owner, data, ctx)
            if lock is not None:
                lock._start_heartbeat()
                return lock
    except BaseException:
        ctx.tokens.drop(owner.token)
        raise
    ctx.tokens.drop(owner.token)
    raise ConcurrentSaveError(
        f"could not take the save lock {storage.url}/{LOCK_FILE}: it kept "
        "changing hands (several jobs are saving to this path)"
    )


def _attempt_once(storage: Storage, owner: LockOwner, data: bytes, ctx: LockContext) -> SaveLock | None:
    """One look at the lock and one exclusive create; None when the lock moved meanwhile."""
    gens = lock_generations(storage)
    top = gens[-1] if gens else None
    raw: bytes | None = None
    reason: str | None = None
    holder: LockOwner | None = None
    if top is not None:
        raw = storage.read(_gen_name(top), SMALL_FILE_LIMIT)
        if raw is None:
            return None  # released meanwhile: look again
        holder = LockOwner.decode(raw)
        if holder is None:
            time.sleep(_UNREADABLE_GRACE_S)  # its creator may be between create and write
            if storage.read(_gen_name(top), SMALL_FILE_LIMIT) != raw:
                return None
            reason = f"it is not a valid lock record: {record_problem(raw)}"
        else:
            reason = stale_reason(holder, held_here=ctx.held_here)
            if reason is None:
                raise ConcurrentSaveError(
                    f"another save is in progress at {storage.url}: {holder.describe()} holds "
                    f"{_gen_name(top)}; wait for it or save to another path"
                )
    mine = 1 if top is None else top + 1
    if not publisher_for(storage).create(_gen_name(mine), data):
        return None  # another job created that generation first
    if top is not None and storage.read(_gen_name(top), SMALL_FILE_LIMIT) != raw:
        storage.delete([_gen_name(mine)])  # what we judged stale changed or went: our view is old
        return None
    older = [_gen_name(g) for g in lock_generations(storage) if g < mine]
    if older:
        storage.delete(older)
    if reason is not None and top is not None:
        who = holder.describe() if holder is not None else "an unknown owner"
        warnings.warn(f"broke the stale save lock {storage.url}/{_gen_name(top)} of {who}: {reason}", stacklevel=4)
    return SaveLock(storage, owner, _gen_name(mine), data, ctx)


def prepare_save(
    storage: Storage, save_id: str, lease_s: float = DEFAULT_LEASE_S, ctx: LockContext | None = None
) -> SaveLock:
    """Rank 0, before any write: the folder is unickpt's, the lock is taken, the data marker of
    ``save_id`` is written. Raises ForeignFolderError / ConcurrentSaveError / StorageError."""
    check_save_folder(storage)
    lock = try_acquire(storage, save_id, lease_s, ctx)
    try:
        mark_save(storage, save_id)
    except BaseException:
        lock.release()
        raise
    return lock


_SHARED_ERRORS: dict[str, type[CheckpointError]] = {
    c.__name__: c for c in (ConcurrentSaveError, ForeignFolderError, UnsafePathError, SizeLimitError, StorageError)
}


def acquire_save_lock(
    coord: Coordinator,
    storage: Storage,
    save_id: str,
    lease_s: float = DEFAULT_LEASE_S,
    ctx: LockContext | None = None,
) -> SaveLock:
    """Collective: rank 0 prepares the save (``prepare_save``), every rank learns the outcome and
    raises the same error type together."""
    lock = SaveLock(storage, None)
    outcome: tuple[str, str, int | None] | None = None  # (error type, message, errno)
    failure: BaseException | None = None
    if coord.rank == 0:
        try:
            lock = prepare_save(storage, save_id, lease_s, ctx)
        except Exception as e:
            failure = e
            code = e.errno if isinstance(e, OSError) and isinstance(e.errno, int) else None
            kind = type(e).__name__ if type(e).__name__ in _SHARED_ERRORS else "StorageError"
            text = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            if isinstance(e, OSError) and e.strerror and isinstance(e, CheckpointError):
                text = e.strerror
            outcome = (kind, text, code)
    if coord.world_size > 1:
        try:
            outcome = coord.broadcast_object(outcome)
        except BaseException:
            lock.release()  # a peer is gone: do not leave the lock behind
            raise
    if outcome is None:
        return lock
    if isinstance(failure, CheckpointError):  # same type and attributes, named by rank and stage
        raise retitled(failure, f"rank 0, lock: {outcome[1]}") from failure
    kind, msg, code = outcome
    if coord.rank == 0:
        msg = f"save (lock) failed on rank 0: taking {storage.url}/{LOCK_FILE}: {msg}"
    else:
        msg = f"rank 0 reports: {msg}"
    cls = _SHARED_ERRORS[kind]
    if issubclass(cls, StorageError):
        raise cls(code, msg) if code is not None else cls(msg)
    raise cls(msg)


def discard_partial_save(storage: Storage, save_id: str, files: Sequence[str], rank: int) -> None:
    """Best effort, every rank, after a failed save: delete this save's data files (``files``
    this rank wrote; rank 0 also every data file under ``data/<save_id>/``, then the save's
    marker), so that a full disk gets its space back. Nothing is deleted when the metadata names
    ``save_id`` (the commit happened before the failure). Never raises; problems become warnings."""
    try:
        if committed_save_id(storage) == save_id:
            return
        own = sorted({n for n in files if n.startswith(f"data/{save_id}/")})
        if own:
            storage.delete(own)
        if rank == 0 and delete_save_data(storage, save_id):
            storage.delete([marker_name(save_id)])
    except Exception as e:
        warnings.warn(
            f"rank {rank}: could not delete the partial data of failed save {save_id} at {storage.url}: {e}",
            stacklevel=2,
        )


def run_locked(
    coord: Coordinator,
    storage: Storage,
    plan: RankSavePlan,
    body: Callable[[SaveLock], T],
    *,
    on_refused: Callable[[], None] | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    ctx: LockContext | None = None,
) -> T:
    """Run ``body(lock)`` (one save's write + commit, collective on ``coord``) under the save lock.

    Every rank calls it with its own ``plan``. The lock is taken first (collective: all ranks
    raise together, after ``on_refused`` has released what the save holds, e.g. its staging
    buffers); ``body`` gets the lock to verify before its commit (``SaveLock.verify_holder``); a
    failing ``body`` discards this save's partial data on every rank; rank 0 releases the lock
    in all cases."""
    try:
        lock = acquire_save_lock(coord, storage, plan.save_id, lease_s, ctx)
    except BaseException:
        if on_refused is not None:
            on_refused()
        raise
    try:
        return body(lock)
    except BaseException:
        discard_partial_save(storage, plan.save_id, plan.paths, coord.rank)
        raise
    finally:
        lock.release()


def checkpoint_replaced(coord: Coordinator, storage: Storage, save_id: str) -> bool:
    """Collective, for a load that failed on a missing/short/corrupt data file: whether the
    checkpoint at ``storage`` has been re-committed by another save since this load read the
    metadata of ``save_id`` (that save's ``remove_stale_data`` may have deleted the data the
    load was reading). The load should then start over on the new metadata. Rank 0 decides."""
    replaced = False
    if coord.rank == 0:
        current = committed_save_id(storage)  # unreadable now: not a newer commit we could load
        replaced = current is not None and current != save_id
    if coord.world_size > 1:
        replaced = bool(coord.broadcast_object(replaced))
    return replaced
