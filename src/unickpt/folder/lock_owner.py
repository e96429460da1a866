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

A record is valid only whole: every field present with its type, and a positive lease
(``record_problem`` names what is wrong otherwise). ``folder.lock`` treats an invalid record
like any unreadable one: not a live holder, broken with a warning that names the problem.
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
    "LockOwner",
    "record_problem",
    "stale_reason",
    "LockTokens",
    "LockContext",
]

DEFAULT_LEASE_S = 60.0
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
    """Who holds a save lock: written into the lock file as JSON, every field (``decode`` accepts
    nothing less). ``for_this_process`` fills them all; the defaults of ``token``, ``boot_id``
    and ``pid_ns`` mean "unknown" (a holder judged by its lease alone)."""

    save_id: str
    host: str
    pid: int
    pid_start: float  # the owner process's start time (psutil), 0.0 if unknown
    created_unix: float
    token: str = ""  # random, one per acquisition
    boot_id: str = ""  # the holder host's boot id
    pid_ns: int = 0  # inode of the holder's PID namespace
    lease_s: float = DEFAULT_LEASE_S  # seconds, > 0: the holder renews the record well within this
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
    def last_beat(self) -> float:
        return self.renewed_unix or self.created_unix

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    @staticmethod
    def decode(data: bytes) -> LockOwner | None:
        """The owner recorded in ``data``, or None when it is not a valid lock record
        (``record_problem`` says why)."""
        return _parse(data)[0]

    def describe(self) -> str:
        age = time.time() - self.created_unix
        return f"save {self.save_id} of pid {self.pid} on host {self.host}, started {age:.0f}s ago"


_FIELDS = tuple(LockOwner.__dataclass_fields__)
_NUMBERS = ("pid_start", "created_unix", "lease_s", "renewed_unix")


def _parse(data: bytes) -> tuple[LockOwner | None, str]:
    """``(owner, "")`` for a valid lock record, else ``(None, what is wrong with it)``."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return None, "it is not JSON"
    if not isinstance(doc, dict):
        return None, "it is not a JSON object"
    missing = [f for f in _FIELDS if f not in doc]
    if missing:
        return None, f"fields {missing} are missing"
    owner = LockOwner(**{f: doc[f] for f in _FIELDS})
    wrong = [f for f in ("save_id", "host", "token", "boot_id") if not isinstance(doc[f], str)]
    wrong += [f for f in ("pid", "pid_ns") if type(doc[f]) is not int]
    wrong += [f for f in _NUMBERS if not isinstance(doc[f], (int, float)) or isinstance(doc[f], bool)]
    if wrong:
        return None, f"fields {wrong} have the wrong type"
    if owner.lease_s <= 0:  # no lease: nothing says how long its holder may be silent
        return None, f"its lease_s is {owner.lease_s!r}, not a positive number of seconds"
    return owner, ""


def record_problem(data: bytes) -> str | None:
    """What makes ``data`` an invalid lock record (a few words for a warning), None when it is valid."""
    return _parse(data)[1] or None


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
    lease, beat = owner.lease_s, owner.last_beat
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
