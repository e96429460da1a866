"""Save lock records: who holds a lock (``LockOwner``, JSON in the lock file) and whether that
holder may still be running (``stale_reason``). Used by ``folder.lock`` (taking, renewing and
breaking locks) and, through it, by ``CheckpointManager`` retention.

A holder is identified by a random token (one per acquisition) besides host, pid and process
start time, and by the boot id of its host and the inode of its PID namespace: its pid is only
looked up where it means the same process (same host, boot and namespace). Its lease is renewed
by a heartbeat (``renewed_unix``); a record whose heartbeat is older than its lease is stale on
any host. The tokens a checkpointer's saves hold live in its ``LockTokens``; ``LockContext``
pairs them with a predicate over every live checkpointer of the process (``held_here``), so
that a lock of this very process is told apart from a leaked one.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import psutil

__all__ = [
    "DEFAULT_LEASE_S",
    "LEGACY_LEASE_S",
    "LockOwner",
    "stale_reason",
    "LockTokens",
    "LockContext",
]

DEFAULT_LEASE_S = 60.0
LEGACY_LEASE_S = 3600.0  # records of unickpt versions without a heartbeat: judged by their age
_PID_LIMIT = 1 << 22  # Linux pid_max can be at most 2^22


class LockTokens:
    """The tokens of the save locks one checkpointer's saves hold now (thread-safe)."""

    def __init__(self) -> None:
        self._held: set[str] = set()
        self._lock = threading.Lock()

    def hold(self, token: str) -> None:
        """Register a lock token (before its lock file exists)."""
        with self._lock:
            self._held.add(token)

    def drop(self, token: str) -> None:
        with self._lock:
            self._held.discard(token)

    def holds(self, token: str) -> bool:
        with self._lock:
            return token in self._held


@dataclass(frozen=True, slots=True)
class LockContext:
    """What the lock code of one checkpointer needs: its own ``tokens``, and ``held_here``:
    whether *any* live checkpointer of this process holds a token (a lock of this process's pid
    that none holds is a leaked one). Without ``held_here`` (the default context of low-level
    callers) a lock of this process is judged by its lease alone, never as leaked."""

    tokens: LockTokens = field(default_factory=LockTokens)
    held_here: Callable[[str], bool] | None = None


def _process_start(pid: int) -> float:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError, ValueError, OverflowError):
        return 0.0


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read(64).strip()
    except OSError:
        return ""


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True, slots=True)
class LockOwner:
    """Who holds a save lock: written into the lock file as JSON. Fields after ``created_unix``
    are absent from locks of older unickpt versions (their defaults mean "unknown")."""

    save_id: str
    host: str
    pid: int
    pid_start: float  # the owner process's start time (psutil), 0.0 if unknown
    created_unix: float
    token: str = ""  # random, one per acquisition
    boot_id: str = ""  # the holder host's boot id
    pid_ns: int = 0  # inode of the holder's PID namespace
    lease_s: float = 0.0  # the holder renews the record well within this (0: legacy, one hour)
    renewed_unix: float = field(default=0.0, compare=False)  # last heartbeat (0: none yet)

    @staticmethod
    def for_this_process(save_id: str, lease_s: float = DEFAULT_LEASE_S) -> LockOwner:
        pid = os.getpid()
        return LockOwner(
            save_id,
            socket.gethostname(),
            pid,
            _process_start(pid),
            time.time(),
            secrets.token_hex(16),
            _boot_id(),
            _pid_namespace(),
            float(lease_s),
        )

    @property
    def lease(self) -> float:
        return self.lease_s if self.lease_s > 0 else LEGACY_LEASE_S

    @property
    def last_beat(self) -> float:
        return self.renewed_unix or self.created_unix

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    @staticmethod
    def decode(data: bytes) -> LockOwner | None:
        """The owner recorded in ``data``, or None when it is not a well-formed lock."""
        try:
            doc = json.loads(data.decode("utf-8"))
            names = [f for f in LockOwner.__dataclass_fields__ if f in doc]
            owner = LockOwner(**{f: doc[f] for f in names})
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None
        number = (int, float)
        if not (
            isinstance(owner.save_id, str)
            and isinstance(owner.host, str)
            and type(owner.pid) is int
            and type(owner.pid_ns) is int
            and isinstance(owner.token, str)
            and isinstance(owner.boot_id, str)
            and all(
                isinstance(v, number) and not isinstance(v, bool)
                for v in (owner.pid_start, owner.created_unix, owner.lease_s, owner.renewed_unix)
            )
        ):
            return None
        return owner

    def describe(self) -> str:
        age = time.time() - self.created_unix
        return f"save {self.save_id} of pid {self.pid} on host {self.host}, started {age:.0f}s ago"


def _same_process_space(owner: LockOwner) -> bool:
    """Whether ``owner``'s pid can be looked up here: same host, same boot, same PID namespace."""
    return (
        owner.host == socket.gethostname()
        and bool(owner.boot_id)
        and owner.pid_ns != 0
        and owner.boot_id == _boot_id()
        and owner.pid_ns == _pid_namespace()
    )


def stale_reason(
    owner: LockOwner, now: float | None = None, held_here: Callable[[str], bool] | None = None
) -> str | None:
    """Why the lock of ``owner`` is stale, or None if its save may still be running.

    ``held_here(token)``: whether a live checkpointer of this process holds ``token``; without it
    a lock of this process's own pid is judged by its lease alone."""
    now = time.time() if now is None else now
    lease, beat = owner.lease, owner.last_beat
    if not all(math.isfinite(v) for v in (lease, beat, owner.created_unix)):
        return "its times are not finite numbers"
    if owner.created_unix - now > lease or beat - now > lease:
        return f"it is dated in the future (beyond its lease of {lease:.1f}s)"
    if now - beat > lease:
        return f"its heartbeat is {now - beat:.1f}s old, beyond its lease of {lease:.1f}s"
    if not _same_process_space(owner):
        return None  # another host, boot or PID namespace: only its lease can tell
    if owner.pid == os.getpid():
        if held_here is None or held_here(owner.token):
            return None
        return "this process holds no save with that token (a leaked lock)"
    if not 0 < owner.pid < _PID_LIMIT or not psutil.pid_exists(owner.pid):
        return f"its process {owner.pid} is gone"
    start = _process_start(owner.pid)
    if owner.pid_start and start and abs(start - owner.pid_start) > 1.0:
        return f"pid {owner.pid} now belongs to another process"
    return None
