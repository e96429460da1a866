"""Storage faults: transient errors are retried, permanent ones fail precisely, a full disk
commits nothing and gets its space back."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch
from torch import nn

import unickpt
from tests.workers.harness import run_ranks
from tests.workers.rel_faults import install_faulty_scheme
from tests.workers.rel_helpers import data_files, mismatches, snapshot, tiny_model
from tests.workers.rel_workers import faulty_save_worker
from unickpt.errors import MissingDataFileError, StorageError, TransientStorageError
from unickpt.format.records import METADATA_FILE
from unickpt.storage import StorageOptions, open_storage
from unickpt.storage.retry import RetryingStorage, RetryPolicy, is_transient, with_retries

# ----------------------------------------------------------------------------- retry policy


def test_policy_delays_grow_exponentially_with_bounded_jitter():
    p = RetryPolicy(initial_delay_s=0.1, multiplier=2.0, max_delay_s=1.0, jitter=0.5)
    for attempt, base in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        delays = [p.delay(attempt) for _ in range(200)]
        assert all(base * 0.5 <= d <= base * 1.5 for d in delays), (attempt, min(delays), max(delays))
        assert max(delays) - min(delays) > base * 0.5  # jitter actually spreads retries
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


@pytest.mark.parametrize(
    "exc,transient",
    [
        (OSError(errno.EIO, "io"), True),
        (OSError(errno.EAGAIN, "again"), True),
        (OSError(errno.EINTR, "intr"), True),
        (OSError(errno.ETIMEDOUT, "timeout"), True),
        (OSError(errno.ECONNRESET, "reset"), True),
        (OSError(errno.EBUSY, "busy"), True),
        (TimeoutError("client timeout"), True),
        (TransientStorageError("throttled"), True),
        (StorageError(errno.EIO, "eio wrapped by a backend"), True),
        (OSError(errno.ENOSPC, "full"), False),
        (OSError(errno.EACCES, "denied"), False),
        (OSError(errno.ENOENT, "missing"), False),
        (OSError(errno.EROFS, "ro"), False),
        (MissingDataFileError("gone"), False),
        (ValueError("bug"), False),
    ],
)
def test_transient_classification(exc, transient):
    assert is_transient(exc) is transient


def test_with_retries_retries_transient_then_succeeds():
    sleeps, calls = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError(errno.EIO, "Input/output error")
        return "done"

    policy = RetryPolicy(initial_delay_s=0.01, jitter=0.0)
    assert with_retries("write", "/x/data/f.bin", flaky, policy, sleep=sleeps.append) == "done"
    assert len(calls) == 3 and sleeps == [0.01, 0.02]


def test_with_retries_gives_up_with_a_precise_error():
    sleeps = []

    def always():
        raise OSError(errno.ETIMEDOUT, "Connection timed out")

    with pytest.raises(StorageError) as ei:
        with_retries("read", "/x/data/f.bin", always, RetryPolicy(max_attempts=4, jitter=0.0), sleep=sleeps.append)
    msg = str(ei.value)
    assert "read /x/data/f.bin failed after 4 attempt(s)" in msg and "timed out" in msg
    assert ei.value.errno == errno.ETIMEDOUT and len(sleeps) == 3


def test_with_retries_fails_permanent_errors_at_once():
    calls = []

    def full():
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StorageError) as ei:
        with_retries("write", "/x/data/f.bin", full, RetryPolicy(), sleep=lambda s: None)
    assert calls == [1] and ei.value.errno == errno.ENOSPC
    assert "write /x/data/f.bin failed (disk full)" in str(ei.value)


def test_open_storage_wraps_every_backend():
    for url in ("/tmp/unickpt-x", "memory://unickpt-x"):
        s = open_storage(url)
        assert isinstance(s, RetryingStorage) and s.url == s.inner.url
        assert isinstance(s, unickpt.storage.Storage)
    assert open_storage("memory://y", StorageOptions(retry=RetryPolicy(max_attempts=2))).policy.max_attempts == 2


# ----------------------------------------------------------------------------- injected faults


def _tiny_state(seed: int = 3) -> dict:
    model, optim = tiny_model(seed=seed)
    return {"model": model, "optimizer": optim}


def test_transient_write_and_read_errors_are_retried(tmp_path):
    state = _tiny_state()
    counters = install_faulty_scheme("write", fail_times=3, errno_code=errno.EIO, match="/data/")
    unickpt.save(f"faulty://{tmp_path}/ck", state, framework="torch")
    assert counters["write injected"] == 3  # three failed attempts, then success
    counters = install_faulty_scheme("read", fail_times=2, errno_code=errno.ETIMEDOUT, match="/data/")
    fresh = _tiny_state(seed=77)
    unickpt.load(f"faulty://{tmp_path}/ck", fresh, framework="torch")
    assert counters["read injected"] == 2
    assert not mismatches(snapshot(fresh["model"], fresh["optimizer"]), snapshot(state["model"], state["optimizer"]))


def test_permanent_write_error_fails_fast_and_names_the_file(tmp_path):
    state = _tiny_state()
    unickpt.save(f"{tmp_path}/ck", state, framework="torch")  # a previous checkpoint
    before = open(f"{tmp_path}/ck/{METADATA_FILE}", "rb").read()
    counters = install_faulty_scheme("write", fail_times=10, errno_code=errno.EACCES, match="/data/")
    other = _tiny_state(seed=5)
    with pytest.raises(StorageError) as ei:
        unickpt.save(f"faulty://{tmp_path}/ck", other, framework="torch")
    tried = {k: n for k, n in counters.items() if k.startswith("write data/")}
    assert tried and set(tried.values()) == {1}, counters  # no retry of a permanent error
    assert counters["write injected"] == len(tried)
    msg = str(ei.value)
    assert ei.value.errno == errno.EACCES and f"{tmp_path}/ck/data/" in msg and ".bin" in msg
    assert open(f"{tmp_path}/ck/{METADATA_FILE}", "rb").read() == before  # nothing committed
    fresh = _tiny_state(seed=77)
    unickpt.load(f"{tmp_path}/ck", fresh, framework="torch")
    assert not mismatches(snapshot(fresh["model"], fresh["optimizer"]), snapshot(state["model"], state["optimizer"]))
    dirs = {f.split("/")[1] for f in data_files(f"{tmp_path}/ck") if f.startswith("data/")}
    assert len(dirs) == 1  # the failed save's partial files were discarded


@pytest.mark.parametrize("errno_code,times,ok", [(errno.EIO, 2, True), (errno.EACCES, 100, False)])
def test_two_ranks_with_faults_on_rank1(tmp_path, errno_code, times, ok):
    path = str(tmp_path / "ck")
    res = run_ranks(faulty_save_worker, 2, path, 1, errno_code, times, str(tmp_path / "ref.pt"))
    if ok:
        assert all(r["ok"] for r in res), res
        assert res[1]["calls"]["write injected"] == 2
        fresh = _tiny_state(seed=77)
        unickpt.load(path, fresh, framework="torch")
        assert not mismatches(
            snapshot(fresh["model"], fresh["optimizer"]), torch.load(str(tmp_path / "ref.pt"), weights_only=True)
        )
        return
    assert not any(r["ok"] for r in res), res
    # every rank raises rank 1's error type (issue 9 item 12: the same fault gives the same error
    # everywhere), its message naming the rank, the stage and the file
    for r in res:
        assert r["type"] == "StorageError", r
        assert "rank 1, save (write): " in r["msg"] and f"{path}/data/" in r["msg"] and "r00001-" in r["msg"], r
    assert not os.path.exists(f"{path}/{METADATA_FILE}")
    assert not [f for f in data_files(path) if f.startswith("data/")]  # partial data discarded


# ----------------------------------------------------------------------------- disk full


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs mounted for the test (root only), unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount an 8 MiB tmpfs (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_disk_full_commits_nothing_and_releases_space(small_fs):
    manager = unickpt.CheckpointManager(f"{small_fs}/run", keep_last=3)
    small = _tiny_state()
    manager.save(1, small, framework="torch")
    ref = snapshot(small["model"], small["optimizer"])
    meta_before = open(f"{manager.path_for(1)}/{METADATA_FILE}", "rb").read()
    torch.manual_seed(0)
    big = {"model": nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 512))}
    free_before = _free(small_fs)
    assert free_before < 10 * 2**20 < sum(p.numel() * 4 for p in big["model"].parameters())

    for target in ("new step", "same path"):
        with pytest.raises(StorageError) as ei:
            if target == "new step":
                manager.save(2, big, framework="torch")
            else:
                unickpt.save(manager.path_for(1), big, framework="torch")
        msg = str(ei.value)
        assert ei.value.errno == errno.ENOSPC and "(disk full)" in msg, msg
        assert f"{small_fs}/run/" in msg and "/data/" in msg and ".bin" in msg, msg
        # nothing committed, latest unchanged, previous checkpoint intact and bit-exact
        assert [c.step for c in manager.list_checkpoints()] == [1]
        assert manager.read_pointer().step == 1
        assert open(f"{manager.path_for(1)}/{METADATA_FILE}", "rb").read() == meta_before
        fresh = _tiny_state(seed=77)
        assert manager.load_latest(fresh, framework="torch") == 1
        assert not mismatches(snapshot(fresh["model"], fresh["optimizer"]), ref)
        # the partial files were deleted: the space is back
        assert _free(small_fs) >= free_before - 64 * 1024, (free_before, _free(small_fs))
        leftovers = [f for f in data_files(f"{small_fs}/run") if not f.startswith("step_00000001/")]
        assert leftovers in ([], ["latest"]), leftovers
        assert len({f.split("/")[1] for f in data_files(manager.path_for(1)) if "/" in f}) == 1
