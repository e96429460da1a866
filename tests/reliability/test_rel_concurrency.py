"""Concurrent jobs at one path: one save at a time (the save lock), stale locks broken, loads
during saves see one complete checkpoint, never a mix."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest
import torch

import unickpt
from tests.workers.harness import run_jobs, run_ranks
from tests.workers.rel_helpers import data_files, lock_record, mismatches, snapshot, tiny_model, write_lock
from tests.workers.rel_workers import locked_save_worker, looping_loader, racing_saver, repeated_saver, version_state
from unickpt.folder.lock import LOCK_FILE, LockOwner, read_lock_owner, stale_reason, try_acquire
from unickpt.format.records import METADATA_FILE
from unickpt.storage import open_storage


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


HELD = f"{LOCK_FILE}.1"  # the generation ``write_lock`` plants


def _lock_files(folder: str) -> list[str]:
    return [f for f in data_files(folder) if f.startswith(LOCK_FILE)]


def test_two_jobs_saving_at_once_exactly_one_commits(tmp_path):
    ckpt, barrier = str(tmp_path / "ck"), str(tmp_path / "barrier")
    os.makedirs(barrier)
    jobs = [(racing_saver, (ckpt, seed, barrier, 3.0, str(tmp_path / f"ref{seed}.pt"))) for seed in (1, 2)]
    res = run_jobs(jobs)
    assert all(r.status == "ok" for r in res), res
    results = [r.result for r in res]
    winners = [r for r in results if r["ok"]]
    losers = [r for r in results if not r["ok"]]
    assert len(winners) == 1 and len(losers) == 1, results
    assert losers[0]["type"] == "ConcurrentSaveError", losers
    assert "another save is in progress" in losers[0]["msg"] and LOCK_FILE in losers[0]["msg"]
    md = json.loads(open(f"{ckpt}/{METADATA_FILE}", "rb").read())
    assert md["save_id"] == winners[0]["save_id"]
    assert {f.split("/")[1] for f in data_files(ckpt) if f.startswith("data/")} == {md["save_id"]}
    assert not _lock_files(ckpt)  # released after the commit
    model, optim = tiny_model(seed=99)
    unickpt.load(ckpt, {"model": model, "optimizer": optim}, framework="torch")
    ref = torch.load(str(tmp_path / f"ref{winners[0]['seed']}.pt"), weights_only=True)
    assert not mismatches(snapshot(model, optim), ref)


def test_every_rank_refuses_when_another_job_holds_the_lock(tmp_path):
    ckpt = str(tmp_path / "ck")
    data = write_lock(ckpt, lock_record())  # this (live) pytest process "holds" it
    res = run_ranks(locked_save_worker, 2, ckpt)
    assert [r["type"] for r in res] == ["ConcurrentSaveError", "ConcurrentSaveError"], res
    assert "rank 0 reports: another save is in progress" in res[1]["msg"]
    assert f"pid {os.getpid()}" in res[0]["msg"]
    assert data_files(ckpt) == [HELD]  # nothing written
    assert open(os.path.join(ckpt, HELD), "rb").read() == data  # and the lock untouched


@pytest.mark.parametrize(
    "case", ["dead pid", "reused pid", "too old", "unreadable", "leaked here", "absurd pid", "dated in the future"]
)
def test_stale_locks_are_broken_with_a_warning(tmp_path, case):
    ckpt = str(tmp_path / "ck")
    if case == "dead pid":
        write_lock(ckpt, lock_record(pid=_dead_pid()))
    elif case == "reused pid":
        write_lock(ckpt, lock_record(pid=os.getppid(), pid_start=12345.0))
    elif case == "too old":
        write_lock(ckpt, lock_record(host="another-host", created_unix=time.time() - 7200))
    elif case == "absurd pid":
        write_lock(ckpt, lock_record(pid=-1))
    elif case == "dated in the future":
        write_lock(ckpt, lock_record(host="another-host", created_unix=time.time() + 10**9))
    elif case == "unreadable":
        os.makedirs(ckpt)
        open(os.path.join(ckpt, HELD), "wb").write(b"\x00garbage")
    else:
        write_lock(ckpt, LockOwner.for_this_process("an-old-save-of-this-process"))
    model, optim = tiny_model()
    with pytest.warns(UserWarning, match="broke the stale save lock"):
        unickpt.save(ckpt, {"model": model, "optimizer": optim}, framework="torch")
    assert os.path.exists(os.path.join(ckpt, METADATA_FILE))
    assert not _lock_files(ckpt) and not [f for f in data_files(ckpt) if ".broken-" in f]


def test_live_lock_of_another_host_is_respected(tmp_path):
    ckpt = str(tmp_path / "ck")
    write_lock(ckpt, lock_record(host="other-" + socket.gethostname(), pid=1))
    model, optim = tiny_model()
    with pytest.raises(unickpt.ConcurrentSaveError, match="on host other-"):
        unickpt.save(ckpt, {"model": model, "optimizer": optim}, framework="torch")
    assert data_files(ckpt) == [HELD]


def test_lock_is_exclusive_within_and_across_calls(tmp_path):
    storage = open_storage(str(tmp_path / "ck"))
    lock = try_acquire(storage, "save-a")
    found = read_lock_owner(storage)
    assert found is not None and found[1] == lock.owner and stale_reason(found[1]) is None
    with pytest.raises(unickpt.ConcurrentSaveError):
        try_acquire(storage, "save-b")  # same live process, another save in flight
    lock.release()
    assert read_lock_owner(storage) is None
    lock_b = try_acquire(storage, "save-b")
    with pytest.warns(UserWarning, match="taken over"):
        lock.release()  # releasing a lock that is no longer ours leaves the new holder's alone
    assert read_lock_owner(storage)[1] == lock_b.owner
    lock_b.release()


def test_memory_backend_gets_the_best_effort_lock():
    storage = open_storage("memory://unickpt-lock-test")
    lock = try_acquire(storage, "save-a")
    with pytest.raises(unickpt.ConcurrentSaveError):
        try_acquire(storage, "save-b")
    lock.release()
    try_acquire(storage, "save-c").release()


def test_loads_during_repeated_saves_see_whole_versions(tmp_path):
    """A loader in a loop while another job re-saves the same path 30 times: every load that
    returns is bit-exact one saved version (never a mix). A load whose data was superseded and
    removed by a newer commit between its metadata read and its data read starts over on the new
    metadata, so no load fails."""
    ckpt, stop = str(tmp_path / "ck"), str(tmp_path / "stop")
    m0, o0 = version_state(0)  # version 0 first, so the loader never sees an empty folder
    unickpt.save(ckpt, {"model": m0, "optimizer": o0, "extra_state": {"version": 0}}, framework="torch")
    res = run_jobs([(repeated_saver, (ckpt, 30, stop)), (looping_loader, (ckpt, stop))])
    assert [r.status for r in res] == ["ok", "ok"], res
    report = res[1].result
    print(
        f"\nload-while-save: {report['loads']} loads saw versions {report['versions']}, {len(report['errors'])} refused"
    )
    assert report["bad"] == [], report  # never a mix of two versions
    assert report["loads"] >= 5 and len(report["versions"]) >= 3, report
    assert report["errors"] == [], report


def test_checkpoint_replaced_tells_a_failed_load_to_start_over(tmp_path):
    from unickpt.coordination import SingleProcessCoordinator
    from unickpt.folder.lock import checkpoint_replaced

    ckpt = str(tmp_path / "ck")
    storage, coord = open_storage(ckpt), SingleProcessCoordinator()
    assert not checkpoint_replaced(coord, storage, "anything")  # nothing committed yet
    model, optim = tiny_model()
    first = unickpt.save(ckpt, {"model": model, "optimizer": optim}, framework="torch").wait().save_id
    assert not checkpoint_replaced(coord, storage, first)
    second = unickpt.save(ckpt, {"model": model, "optimizer": optim}, framework="torch").wait().save_id
    assert checkpoint_replaced(coord, storage, first) and not checkpoint_replaced(coord, storage, second)
