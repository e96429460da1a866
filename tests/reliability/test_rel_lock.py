"""The save lock (issue 9, item 4): a holder is identified by more than host + pid (boot id,
PID namespace, a random token), holds a lease it renews by a heartbeat, loses to nobody while it
renews it, and checks before the commit that it still holds the lock and that every data file it
names is there in full. Breaking a stale lock is one exclusive create: of two breakers exactly
one wins, and a breaker acting on an old view never takes a newer holder's lock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import unickpt
from tests.workers.rel_helpers import data_files, lock_record, mismatches, snapshot, tiny_model, write_lock
from unickpt.folder.lock import LOCK_FILE, LockOwner, read_lock_owner, stale_reason, try_acquire
from unickpt.format.records import METADATA_FILE
from unickpt.storage import open_storage

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _state(seed: int = 0) -> dict:
    model, optim = tiny_model(seed=seed)
    return {"model": model, "optimizer": optim, "extra_state": {"seed": seed}}


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _lock_files(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(LOCK_FILE))


# ----------------------------------------------------------------------------- identity


_HOLDER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    from unickpt.folder.lock import try_acquire
    from unickpt.storage import open_storage
    ckpt, ready, stop = sys.argv[2:5]
    lease = {"lease_s": float(sys.argv[5])} if len(sys.argv) > 5 else {}
    lock = try_acquire(open_storage(ckpt), "holder-save", **lease)
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.01)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lock.release()
    print("RELEASED", [str(w.message) for w in caught], flush=True)
""")


def _unshare_works() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare binary"
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"unshare --pid --fork --mount-proc fails here: {r.stderr.strip()}"


def test_item4_lock_holder_in_other_pid_namespace(tmp_path):
    """A live job in another PID namespace of this host (same host name, its pid is 1, as in a
    container with host networking) holds the lock: a save here must not break it."""
    why = _unshare_works()
    if why:
        pytest.skip(why)
    ckpt, ready, stop = str(tmp_path / "ck"), str(tmp_path / "ready"), str(tmp_path / "stop")
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _HOLDER, SRC, ckpt, ready, stop],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(lambda: os.path.exists(ready) or holder.poll() is not None, "the holder")
        assert holder.poll() is None, holder.communicate()
        assert open(ready).read() == "1"  # the holder is pid 1 of its namespace; so is init here
        before = _lock_files(ckpt)
        with pytest.raises(unickpt.ConcurrentSaveError, match="pid 1 "):
            unickpt.save(ckpt, _state(), framework="torch")
        assert _lock_files(ckpt) == before
        assert not [f for f in data_files(ckpt) if f.startswith("data/")]
    finally:
        open(stop, "w").close()
        out, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
    assert "RELEASED []" in out, out  # released its own lock: nobody had taken it over
    assert _lock_files(ckpt) == []


def test_item4_pids_are_judged_only_in_the_holders_own_namespace_and_boot():
    dead = _dead_pid()
    me = lock_record()
    assert stale_reason(lock_record(pid=dead)) is not None  # same host, boot and namespace: gone
    assert stale_reason(lock_record(pid=dead, pid_ns=me.pid_ns + 1)) is None  # another namespace
    assert stale_reason(lock_record(pid=dead, boot_id="0" * 32)) is None  # another boot of the host
    assert stale_reason(lock_record(pid=1, pid_ns=me.pid_ns + 1)) is None
    assert stale_reason(lock_record(pid=dead, host="elsewhere")) is None
    old = time.time() - 10 * me.lease_s
    for other in ({}, {"host": "elsewhere"}, {"pid_ns": me.pid_ns + 1}, {"boot_id": "0" * 32}):
        why = stale_reason(lock_record(renewed_unix=old, **other))  # no heartbeat for ten leases
        assert why is not None and "heartbeat" in why, (other, why)
    assert stale_reason(lock_record(host="elsewhere", renewed_unix=time.time(), created_unix=old)) is None


def test_item4_heartbeat_keeps_a_lock_alive_and_a_frozen_holder_loses_it_after_its_lease(tmp_path):
    """A holder renews its lease while it runs (a save longer than the lease keeps its lock); a
    holder that stops renewing (frozen with SIGSTOP: alive, same host) loses it after the lease."""
    ckpt, ready, stop = str(tmp_path / "ck"), str(tmp_path / "ready"), str(tmp_path / "stop")
    lease = 1.5
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, SRC, ckpt, ready, stop, str(lease)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    storage = open_storage(ckpt)
    try:
        _wait_for(lambda: os.path.exists(ready) or holder.poll() is not None, "the holder")
        assert holder.poll() is None, holder.communicate()
        start = time.monotonic()
        while time.monotonic() - start < 3 * lease:  # three leases long: renewed all along
            found = read_lock_owner(storage)
            assert found is not None and found[1] is not None and stale_reason(found[1]) is None, found
            with pytest.raises(unickpt.ConcurrentSaveError):
                try_acquire(storage, "intruder").release()
        os.kill(holder.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        taken = None
        with pytest.warns(UserWarning, match="broke the stale save lock .* its heartbeat is .* beyond its lease"):
            while taken is None:
                try:
                    taken = try_acquire(storage, "after-the-lease")
                except unickpt.ConcurrentSaveError:
                    assert time.monotonic() - frozen < 60, "the frozen holder's lock was never broken"
                    time.sleep(0.05)
        os.kill(holder.pid, signal.SIGCONT)
        open(stop, "w").close()
        out, err = holder.communicate(timeout=60)
        assert "taken over" in out, (out, err)  # the resumed holder leaves the new lock alone
        assert read_lock_owner(storage)[1] == taken.owner
        taken.release()
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
            open(stop, "w").close()
            holder.communicate(timeout=60)


# ----------------------------------------------------------------------------- breaking


class _StallingStorage:
    """Wraps a storage: a thread that reads the planted stale lock bytes waits at ``barrier``
    (so every breaker has seen the same stale lock before any acts); thread ``late`` then also
    waits for ``go`` before it continues."""

    def __init__(self, inner, stale: bytes, barrier: threading.Barrier, late: str | None, go: threading.Event):
        self._inner, self._stale, self._barrier, self._late, self._go = inner, stale, barrier, late, go
        self._seen: set[str] = set()
        self.url = inner.url

    def read(self, name, *args, **kwargs):
        data = self._inner.read(name, *args, **kwargs)
        me = threading.current_thread().name
        if data == self._stale and me not in self._seen:
            self._seen.add(me)
            self._barrier.wait(timeout=60)
            if me == self._late:
                assert self._go.wait(timeout=60)
        return data

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


def _plant_stale(folder, generation: int = 1) -> bytes:
    return write_lock(folder, lock_record(save_id="crashed", pid=_dead_pid()), generation)


@pytest.mark.parametrize("order", ["simultaneous", "late"])
def test_item4_two_breakers_of_one_stale_lock_exactly_one_wins(tmp_path, monkeypatch, order):
    """Both breakers read the same stale lock before either acts. ``late``: breaker 1 acts only
    after breaker 0 holds the lock; a third job trying at the moment breaker 1 acts (here: where
    the old rename-check-relink left the name empty) must find the lock held."""
    ckpt = str(tmp_path / "ck")
    stale = _plant_stale(ckpt)
    storage = open_storage(ckpt)
    barrier, go = threading.Barrier(2), threading.Event()
    proxy = _StallingStorage(storage, stale, barrier, "breaker-1" if order == "late" else None, go)
    got: dict[str, object] = {}
    third: list[object] = []
    real_link = os.link

    def link(*a, **k):  # the loser's action, if it ever vacates the lock name
        try:
            third.append(try_acquire(storage, "third"))
        except unickpt.ConcurrentSaveError as e:
            third.append(e)
        return real_link(*a, **k)

    monkeypatch.setattr(os, "link", link)

    def breaker(i: int) -> None:
        try:
            got[f"breaker-{i}"] = try_acquire(proxy, f"breaker-{i}")
        except unickpt.ConcurrentSaveError as e:
            got[f"breaker-{i}"] = e
        finally:
            if i == 0:
                go.set()

    threads = [threading.Thread(target=breaker, args=(i,), name=f"breaker-{i}") for i in range(2)]
    with pytest.warns(UserWarning, match="broke the stale save lock"):
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    if not third:
        try:
            third.append(try_acquire(storage, "third"))
        except unickpt.ConcurrentSaveError as e:
            third.append(e)
    outcomes = list(got.values()) + third
    holders = [x for x in outcomes if not isinstance(x, Exception)]
    assert len(holders) == 1, outcomes
    assert all(isinstance(x, unickpt.ConcurrentSaveError) for x in outcomes if x is not holders[0]), outcomes
    if order == "late":
        assert holders[0] is got["breaker-0"]
    assert read_lock_owner(storage)[1] == holders[0].owner
    holders[0].release()
    assert read_lock_owner(storage) is None and _lock_files(ckpt) == []


def test_item4_stalled_breaker_never_takes_a_newer_lock(tmp_path):
    """Breaker E reads a stale lock and stalls; meanwhile B breaks it, saves, releases, and C takes
    the free lock. When E acts on its old view it must neither hold nor disturb C's lock."""
    ckpt = str(tmp_path / "ck")
    stale = _plant_stale(ckpt, 5)
    storage = open_storage(ckpt)
    barrier, go = threading.Barrier(1), threading.Event()
    proxy = _StallingStorage(storage, stale, barrier, "stalled", go)
    out: list[object] = []

    def stalled() -> None:
        try:
            out.append(try_acquire(proxy, "stalled"))
        except unickpt.ConcurrentSaveError as e:
            out.append(e)

    t = threading.Thread(target=stalled, name="stalled")
    t.start()
    with pytest.warns(UserWarning, match="broke the stale save lock"):
        b = try_acquire(storage, "b")
    b.release()
    c = try_acquire(storage, "c")
    go.set()
    t.join(60)
    assert len(out) == 1 and isinstance(out[0], unickpt.ConcurrentSaveError), out
    assert read_lock_owner(storage)[1] == c.owner
    c.verify_holder()  # C still holds the lock, as far as its pre-commit check can tell
    c.release()
    assert _lock_files(ckpt) == []


# ----------------------------------------------------------------------------- before the commit


def _on_commit(action):
    """A listener running ``action(event)`` on rank 0 when the commit begins."""

    def listener(ev):
        if ev.phase == "save.commit.begin" and ev.rank == 0:
            action(ev)

    return listener


def test_item4_commit_refused_when_the_lock_was_taken_over(tmp_path):
    """Another job judged this save's lock stale and took it while this save was writing: the
    commit is refused (nothing published: the previous checkpoint still loads) and the other
    job's lock is left alone."""
    ckpt = str(tmp_path / "ck")
    unickpt.save(ckpt, _state(1), framework="torch")
    before = open(os.path.join(ckpt, METADATA_FILE), "rb").read()
    others = []

    def take_over(ev):
        for name in _lock_files(ckpt):  # this save's lock now looks like a dead job's ...
            with open(os.path.join(ckpt, name), "wb") as f:
                f.write(lock_record(save_id=ev.save_id, pid=_dead_pid()).encode())
        with pytest.warns(UserWarning, match="broke the stale save lock"):
            others.append(try_acquire(open_storage(ckpt), "other-job"))  # ... and is taken

    listener = _on_commit(take_over)
    unickpt.default_checkpointer().events.add_listener(listener)
    try:
        with pytest.raises(unickpt.ConcurrentSaveError, match="lock") as ei:
            unickpt.save(ckpt, _state(2), framework="torch")
    finally:
        unickpt.default_checkpointer().events.remove_listener(listener)
    assert type(ei.value).__name__ == "SaveLockLostError", ei.value
    assert open(os.path.join(ckpt, METADATA_FILE), "rb").read() == before
    assert read_lock_owner(open_storage(ckpt))[1] == others[0].owner
    others[0].release()
    check = _state(9)
    unickpt.load(ckpt, check, framework="torch")
    assert not mismatches(snapshot(check["model"], check["optimizer"]), snapshot(*tiny_model(seed=1)))


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_item4_commit_refused_when_a_data_file_is_missing_or_short(tmp_path, damage):
    ckpt = str(tmp_path / "ck")
    unickpt.save(ckpt, _state(1), framework="torch")
    before = open(os.path.join(ckpt, METADATA_FILE), "rb").read()

    def hurt(ev):
        name = os.path.join(ckpt, "data", ev.save_id, "r00000-00.bin")
        if damage == "missing":
            os.unlink(name)
        else:
            os.truncate(name, os.path.getsize(name) - 1)

    listener = _on_commit(hurt)
    unickpt.default_checkpointer().events.add_listener(listener)
    try:
        with pytest.raises(unickpt.CheckpointError, match="r00000-00.bin") as ei:
            unickpt.save(ckpt, _state(2), framework="torch")
    finally:
        unickpt.default_checkpointer().events.remove_listener(listener)
    want = unickpt.MissingDataFileError if damage == "missing" else unickpt.TruncatedDataFileError
    assert isinstance(ei.value, want) and "refus" in str(ei.value), ei.value
    assert open(os.path.join(ckpt, METADATA_FILE), "rb").read() == before
    check = _state(9)
    unickpt.load(ckpt, check, framework="torch")
    assert not mismatches(snapshot(check["model"], check["optimizer"]), snapshot(*tiny_model(seed=1)))
    assert json.loads(before)["save_id"] in {f.split("/")[1] for f in data_files(ckpt) if f.startswith("data/")}


def test_a_lock_heartbeat_rewrite_never_shows_a_reader_a_stale_tail(tmp_path, monkeypatch):
    """The heartbeat rewrites the lock file in place (``update_exclusive``: write, then cut to
    length). A renewed record shorter than the one it replaces (a float with fewer digits) would
    leave the old record's last bytes readable until the cut: a reader right there must still
    decode a whole record (found as a flake of the heartbeat test under load)."""
    from unickpt.folder import lock as lock_mod
    from unickpt.storage import local

    ckpt = str(tmp_path / "ck")
    storage = open_storage(ckpt)
    lock = try_acquire(storage, "renewer", lease_s=3600.0)  # the heartbeat thread stays asleep
    stamps = [1795471636.7570846, 1795471637.5]  # the second renewal's record is 5 bytes shorter
    monkeypatch.setattr(lock_mod, "time", type("Clock", (), {"time": staticmethod(lambda: stamps.pop(0))}))
    seen: list[bytes] = []
    real_ftruncate = local.os.ftruncate

    def ftruncate(fd: int, length: int) -> None:  # the instant between the write and the cut
        seen.append(os.pread(fd, 1 << 16, 0))
        real_ftruncate(fd, length)

    monkeypatch.setattr(local.os, "ftruncate", ftruncate)
    try:
        for _ in range(2):
            lock.renew()
    finally:
        monkeypatch.setattr(local.os, "ftruncate", real_ftruncate)
        lock.release()
    assert len(seen) == 2, seen
    for raw in seen:
        owner = LockOwner.decode(raw)
        assert owner is not None and owner.save_id == "renewer", raw
