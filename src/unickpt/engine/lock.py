"""One save at a time per checkpoint path: the save lock, and cleanup after a failed save.

Who calls what, in order. ``api.save`` (every rank) snapshots, then hands the save's write +
commit to the save worker wrapped in ``run_locked(background_coord, storage, rank_plan, body)``,
which on every rank, in the worker thread, before any data byte is written:
  1. ``acquire_save_lock`` — collective. Rank 0 creates ``unickpt.save.lock`` in the checkpoint
     folder with an exclusive create (O_CREAT|O_EXCL on local/NFS paths) holding ``LockOwner``
     (save id, host, pid, process start time, creation time) as JSON, then broadcasts the
     outcome: if another live job holds the lock, *every* rank raises ``ConcurrentSaveError``
     naming the holder, so no rank is left waiting in a collective. Saves queued in one process
     run one after the other on the worker, so consecutive saves to one path never collide.
  2. ``body``: the writes and the commit (``engine.save``); after the commit rank 0 removes
     stale data (``remove_stale_data``) *while still holding the lock*, so it can never delete
     the data of another save in progress at the same path (that save would hold the lock).
  3. on failure, ``discard_partial_save`` (every rank, best effort) deletes this save's own
     ``data/<save_id>/`` files, unless the metadata already names this save (a commit that
     failed after publishing) — a full disk gets its space back.
  4. ``SaveLock.release()`` — rank 0, after the commit or the failure. It deletes the lock only
     if it still holds this save's owner.
``CheckpointManager`` retention reads locks (``LockOwner.decode`` + ``stale_reason``) to never
delete the folder of a save in progress. Loads take no lock: a load that loses its data to a
newer commit at the same path fails with MissingDataFileError; ``checkpoint_replaced`` tells
the loader (collectively) that it may start over on the new metadata.

A lock is *stale* — broken with a warning — when its owner process is gone (same host: pid not
alive, or alive but started at another time, i.e. a reused pid; or this very process, which has
no save with that id in flight), when it is older than ``stale_after_s`` (any host), or when it
stays unreadable. Breaking is atomic on local paths (``LocalStorage.break_lock``: rename, verify,
restore on mismatch), so two jobs breaking the same stale lock cannot both win.

Limitation: backends without ``create_exclusive`` (``memory://``, object stores without
conditional writes) get a best-effort lock: check, write, read back. Two jobs that start within
the same instant on such a backend may both proceed; jobs that overlap by more than a round trip
are still told apart. A lock of a live job on another host is only broken after
``stale_after_s`` (default one hour): a save that runs longer than that must not share its path.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

import psutil

from ..coordination.base import Coordinator
from ..errors import CheckpointError, ConcurrentSaveError, StorageError
from ..format.records import DATA_DIR
from ..planning.save_plan import RankSavePlan
from ..storage.base import Storage
from .save import committed_save_id

__all__ = [
    "LOCK_FILE",
    "DEFAULT_STALE_AFTER_S",
    "LockOwner",
    "SaveLock",
    "acquire_save_lock",
    "try_acquire",
    "read_lock_owner",
    "stale_reason",
    "discard_partial_save",
    "run_locked",
    "checkpoint_replaced",
]

T = TypeVar("T")

LOCK_FILE = "unickpt.save.lock"
DEFAULT_STALE_AFTER_S = 3600.0
_UNREADABLE_GRACE_S = 0.5
_PID_LIMIT = 1 << 22  # Linux pid_max can be at most 2^22
_HELD: set[str] = set()  # save ids whose lock this process holds (to tell a leak from a live save)
_HELD_LOCK = threading.Lock()


def _process_start(pid: int) -> float:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError, ValueError, OverflowError):
        return 0.0


@dataclass(frozen=True, slots=True)
class LockOwner:
    """Who holds a save lock: written into the lock file as JSON."""

    save_id: str
    host: str
    pid: int
    pid_start: float  # the owner process's start time (psutil), 0.0 if unknown
    created_unix: float

    @staticmethod
    def for_this_process(save_id: str) -> LockOwner:
        pid = os.getpid()
        return LockOwner(save_id, socket.gethostname(), pid, _process_start(pid), time.time())

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    @staticmethod
    def decode(data: bytes) -> LockOwner | None:
        """The owner recorded in ``data``, or None when it is not a well-formed lock."""
        try:
            doc = json.loads(data.decode("utf-8"))
            owner = LockOwner(doc["save_id"], doc["host"], doc["pid"], doc["pid_start"], doc["created_unix"])
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None
        if not (
            isinstance(owner.save_id, str)
            and isinstance(owner.host, str)
            and type(owner.pid) is int
            and isinstance(owner.pid_start, (int, float))
            and isinstance(owner.created_unix, (int, float))
        ):
            return None
        return owner

    def describe(self) -> str:
        age = time.time() - self.created_unix
        return f"save {self.save_id} of pid {self.pid} on host {self.host}, started {age:.0f}s ago"


def stale_reason(
    owner: LockOwner, stale_after_s: float = DEFAULT_STALE_AFTER_S, now: float | None = None
) -> str | None:
    """Why the lock of ``owner`` is stale, or None if its save may still be running."""
    now = time.time() if now is None else now
    if not math.isfinite(owner.created_unix) or abs(now - owner.created_unix) > stale_after_s:
        return f"it is older than {stale_after_s:.0f}s (or dated in the future)"
    if owner.host != socket.gethostname():
        return None  # cannot see that host's processes: trust the lock until it ages out
    if owner.pid == os.getpid():
        with _HELD_LOCK:
            live = owner.save_id in _HELD
        return None if live else "this process holds no save with that id (a leaked lock)"
    if not 0 < owner.pid < _PID_LIMIT or not psutil.pid_exists(owner.pid):
        return f"its process {owner.pid} is gone"
    start = _process_start(owner.pid)
    if owner.pid_start and start and abs(start - owner.pid_start) > 1.0:
        return f"pid {owner.pid} now belongs to another process"
    return None


def read_lock_owner(storage: Storage) -> tuple[bytes, LockOwner | None] | None:
    """The raw lock bytes and their decoded owner, or None when no lock file exists."""
    data = storage.read(LOCK_FILE)
    return None if data is None else (data, LockOwner.decode(data))


@dataclass(frozen=True, slots=True)
class SaveLock:
    """This rank's part of a save lock. Only rank 0's (``owner`` set) holds the lock file."""

    storage: Storage
    owner: LockOwner | None

    def release(self) -> None:
        """Delete the lock file if it is still ours (rank 0; no-op elsewhere). Never raises: a
        lock that cannot be removed is broken later as a leaked lock, with a warning."""
        if self.owner is None:
            return
        with _HELD_LOCK:
            _HELD.discard(self.owner.save_id)
        try:
            current = self.storage.read(LOCK_FILE)
            if current == self.owner.encode():
                self.storage.delete([LOCK_FILE])
            elif current is not None:
                warnings.warn(
                    f"save lock {self.storage.url}/{LOCK_FILE} was taken over by "
                    f"another job while {self.owner.save_id} ran; leaving it",
                    stacklevel=2,
                )
        except CheckpointError as e:
            warnings.warn(f"could not release save lock {self.storage.url}/{LOCK_FILE}: {e}", stacklevel=2)


def _create(storage: Storage, data: bytes) -> bool:
    create = getattr(storage, "create_exclusive", None)
    if create is not None:
        return bool(create(LOCK_FILE, data))
    # best effort (see the module docstring): check, write, read back
    if storage.read(LOCK_FILE) is not None:
        return False
    storage.write(LOCK_FILE, [data])
    return storage.read(LOCK_FILE) == data


def _break(storage: Storage, expected: bytes) -> bool:
    breaker = getattr(storage, "break_lock", None)
    if breaker is not None:
        return bool(breaker(LOCK_FILE, expected))
    if storage.read(LOCK_FILE) != expected:
        return False
    storage.delete([LOCK_FILE])
    return True


def try_acquire(
    storage: Storage,
    save_id: str,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
) -> SaveLock:
    """One process: take the save lock of ``storage`` for ``save_id`` or raise
    ``ConcurrentSaveError`` naming the holder. Stale locks are broken with a warning."""
    owner = LockOwner.for_this_process(save_id)
    data = owner.encode()
    for _attempt in range(4):
        if _create(storage, data):
            with _HELD_LOCK:
                _HELD.add(save_id)
            return SaveLock(storage, owner)
        found = read_lock_owner(storage)
        if found is None:
            continue  # released meanwhile: try again
        raw, holder = found
        if holder is None:
            time.sleep(_UNREADABLE_GRACE_S)  # its creator may be between create and write
            again = read_lock_owner(storage)
            if again is None or again[0] != raw:
                continue
            reason: str | None = "its content is unreadable"
        else:
            reason = stale_reason(holder, stale_after_s)
            if reason is None:
                raise ConcurrentSaveError(
                    f"another save is in progress at {storage.url}: {holder.describe()} holds "
                    f"{LOCK_FILE}; wait for it or save to another path"
                )
        if _break(storage, raw):
            who = holder.describe() if holder is not None else "an unknown owner"
            warnings.warn(f"broke the stale save lock {storage.url}/{LOCK_FILE} of {who}: {reason}", stacklevel=3)
    raise ConcurrentSaveError(
        f"could not take the save lock {storage.url}/{LOCK_FILE}: it kept "
        "changing hands (several jobs are saving to this path)"
    )


def acquire_save_lock(
    coord: Coordinator, storage: Storage, save_id: str, stale_after_s: float = DEFAULT_STALE_AFTER_S
) -> SaveLock:
    """Collective: rank 0 takes the lock, every rank learns the outcome and raises together."""
    lock = SaveLock(storage, None)
    outcome: tuple[str, str, int | None] | None = None  # (kind, message, errno)
    if coord.rank == 0:
        try:
            lock = try_acquire(storage, save_id, stale_after_s)
        except ConcurrentSaveError as e:
            outcome = ("concurrent", str(e), None)
        except Exception as e:
            code = e.errno if isinstance(e, OSError) else None
            outcome = ("storage", f"{type(e).__name__}: {e}", code)
    if coord.world_size > 1:
        try:
            outcome = coord.broadcast_object(outcome)
        except BaseException:
            lock.release()  # a peer is gone: do not leave the lock behind
            raise
    if outcome is None:
        return lock
    kind, msg, code = outcome
    if kind == "concurrent":
        raise ConcurrentSaveError(msg if coord.rank == 0 else f"rank 0 reports: {msg}")
    text = f"save (lock) failed on rank 0: taking {storage.url}/{LOCK_FILE}: {msg}"
    raise StorageError(code, text) if code is not None else StorageError(text)


def discard_partial_save(storage: Storage, save_id: str, files: Sequence[str], rank: int) -> None:
    """Best effort, every rank, after a failed save: delete this save's data files (``files``
    this rank wrote; rank 0 also whatever else lies under ``data/<save_id>/``), so that a full
    disk gets its space back. Nothing is deleted when the metadata names ``save_id`` (the commit
    happened before the failure). Never raises; problems become warnings."""
    try:
        if committed_save_id(storage) == save_id:
            return
        names = list(files)
        if rank == 0:
            names += storage.list(f"{DATA_DIR}/{save_id}/")
        names = sorted({n for n in names if n.startswith(f"{DATA_DIR}/{save_id}/")})
        if names:
            storage.delete(names)
    except Exception as e:
        warnings.warn(
            f"rank {rank}: could not delete the partial data of failed save {save_id} at {storage.url}: {e}",
            stacklevel=2,
        )


def run_locked(
    coord: Coordinator,
    storage: Storage,
    plan: RankSavePlan,
    body: Callable[[], T],
    *,
    on_refused: Callable[[], None] | None = None,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
) -> T:
    """Run ``body`` (one save's write + commit, collective on ``coord``) under the save lock.

    Every rank calls it with its own ``plan``. The lock is taken first (collective: all ranks
    raise ``ConcurrentSaveError`` together, after ``on_refused`` has released what the save
    holds, e.g. its staging buffers); a failing ``body`` discards this save's partial data on
    every rank; rank 0 releases the lock in all cases."""
    try:
        lock = acquire_save_lock(coord, storage, plan.save_id, stale_after_s)
    except BaseException:
        if on_refused is not None:
            on_refused()
        raise
    try:
        return body()
    except BaseException:
        discard_partial_save(storage, plan.save_id, plan.files, coord.rank)
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
