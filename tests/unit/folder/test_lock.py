"""The save lock's generations (``folder.lock``) on ``MemoryStorage`` with a fake clock, no
process and no sleep: a free lock is taken as generation 1; a live holder (heartbeat within its
lease) refuses a second taker; once the clock passes the lease, the next taker breaks it by
creating generation 2 and removing generation 1, the old holder's commit check fails, its release
leaves the new lock alone, and the new holder's release frees the path."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from unickpt.errors import ConcurrentSaveError, SaveLockLostError
from unickpt.folder import lock, lock_owner
from unickpt.folder.lock import lock_generations, read_lock_owner, try_acquire
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
