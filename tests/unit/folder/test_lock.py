"""The save lock's generations (``folder.lock``) on ``MemoryStorage`` with a fake clock, no
process and no sleep: a free lock is taken as generation 1; a live holder (heartbeat within its
lease) refuses a second taker; once the clock passes the lease, the next taker breaks it by
creating generation 2 and removing generation 1, the old holder's commit check fails, its release
leaves the new lock alone, and the new holder's release frees the path."""

from __future__ import annotations

import json
import os
import socket
import time
from types import SimpleNamespace

import pytest

from unickpt.errors import ConcurrentSaveError, ForeignFolderError, SaveLockLostError
from unickpt.folder import lock, lock_owner
from unickpt.folder.cleanup import checkpoint_files
from unickpt.folder.lock import lock_generations, lock_is_live, read_lock_owner, try_acquire
from unickpt.folder.markers import check_save_folder
from unickpt.storage.memory import MemoryStorage, MemoryStore

LEASE_S = 60.0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The wall clock the lock code reads (``time.time``), moved by hand; the rest of ``time``
    is the real one."""
    fake = SimpleNamespace(now=1_800_000_000.0, sleep=time.sleep, monotonic=time.monotonic)
    fake.time = lambda: fake.now
    monkeypatch.setattr(lock_owner, "time", fake)
    monkeypatch.setattr(lock, "time", fake)
    return fake


def test_lock_generations_are_taken_refused_broken_and_released_on_a_fake_clock(clock) -> None:
    storage = MemoryStorage("lock-generations", store=MemoryStore())
    assert lock_generations(storage) == [] and read_lock_owner(storage) is None

    # (each holder's heartbeat renews every lease / 6 = 10 s of real time: none during this test)
    first = try_acquire(storage, "save-1", lease_s=LEASE_S)
    assert lock_generations(storage) == [1] and first.name == "unickpt.save.lock.1"
    found = read_lock_owner(storage)
    assert found is not None and found[1] is not None and found[1].save_id == "save-1"

    clock.now += LEASE_S / 2  # within the lease: the holder is live
    with pytest.raises(ConcurrentSaveError, match="save-1"):
        try_acquire(storage, "save-2", lease_s=LEASE_S)
    assert lock_generations(storage) == [1]

    clock.now += LEASE_S  # no heartbeat for 1.5 leases: stale
    with pytest.warns(UserWarning, match=r"broke the stale save lock .*unickpt\.save\.lock\.1"):
        second = try_acquire(storage, "save-2", lease_s=LEASE_S)
    try:
        assert lock_generations(storage) == [2] and second.name == "unickpt.save.lock.2"
        found = read_lock_owner(storage)
        assert found is not None and found[1] is not None and found[1].save_id == "save-2"
        with pytest.raises(SaveLockLostError):
            first.verify_holder()  # the old holder must not commit
        second.verify_holder()  # the new one may
        with pytest.warns(UserWarning, match="taken over by another job while save-1 ran"):
            first.release()  # not its generation any more: leaves it
        assert lock_generations(storage) == [2]
    finally:
        second.release()
    assert lock_generations(storage) == [] and read_lock_owner(storage) is None
    third = try_acquire(storage, "save-3", lease_s=LEASE_S)  # a free path starts over at 1
    try:
        assert lock_generations(storage) == [1]
    finally:
        third.release()


def _record(**fields: object) -> bytes:
    """A lock record written by hand: a holder on this host, just started, with ``fields``."""
    doc = {"save_id": "someone", "host": socket.gethostname(), "pid": os.getpid(), "pid_start": 0.0}
    doc.update(created_unix=time.time(), **fields)
    return json.dumps(doc).encode()


def test_issue41_item3_old_lock_formats_are_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of unickpt was released, so the lock reads its current format only. A bare
    ``unickpt.save.lock`` (once "generation 0") is a file unickpt does not write: not a lock
    (even holding a live holder's record), never deleted, and a folder holding nothing else is
    foreign. A record without a lease (once "legacy, one hour") or with lease_s 0 is an invalid
    record, treated as an unreadable one: not live, broken with a warning that names the lease."""
    monkeypatch.setattr(lock, "_UNREADABLE_GRACE_S", 0.0)  # no creator is between create and write here
    live = _record(token="t", boot_id="", pid_ns=0, lease_s=3600.0, renewed_unix=time.time())

    storage = MemoryStorage("old-gen-0", store=MemoryStore())
    storage.put("unickpt.save.lock", live)
    with pytest.raises(ForeignFolderError, match="unickpt.save.lock"):
        check_save_folder(storage)  # not one of unickpt's names
    assert lock_generations(storage) == [] and read_lock_owner(storage) is None and not lock_is_live(storage)
    taken = try_acquire(storage, "save-1")  # the path is free: generation 1
    try:
        assert taken.name == "unickpt.save.lock.1"
        taken.verify_holder()
    finally:
        taken.release()
    assert storage.list("") == ["unickpt.save.lock"] and storage.read("unickpt.save.lock") == live
    storage.put("unickpt.data.save-1", b"{}")  # a unickpt folder now; the foreign file is not its to delete
    assert "unickpt.save.lock" not in sum(checkpoint_files(storage), ())

    for leaseless in (
        _record(),  # the fields of an old record only
        _record(token="t", boot_id="", pid_ns=0, lease_s=0, renewed_unix=0.0),
        _record(token="t", boot_id="", pid_ns=0, lease_s=-60.0, renewed_unix=time.time()),
    ):
        storage = MemoryStorage("old-leaseless", store=MemoryStore())
        storage.put("unickpt.save.lock.1", leaseless)
        assert lock_generations(storage) == [1]
        found = read_lock_owner(storage)
        assert found == (leaseless, None), found  # read, and reported invalid
        assert not lock_is_live(storage)
        why = lock_owner.record_problem(leaseless)
        assert why is not None and "lease_s" in why, why
        with pytest.warns(
            UserWarning, match=r"broke the stale save lock .*unickpt\.save\.lock\.1 .*not a valid lock record.*lease_s"
        ):
            taken = try_acquire(storage, "save-2")
        try:
            assert taken.name == "unickpt.save.lock.2" and lock_generations(storage) == [2]
        finally:
            taken.release()
