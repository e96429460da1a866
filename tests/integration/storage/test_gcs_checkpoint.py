"""unickpt checkpoints on ``gs://`` against a real GCS emulator (fake-gcs-server on loopback,
``gcsserver.py``; ``STORAGE_EMULATOR_HOST`` reaches the spawned ranks through the environment):
resharding bit for bit (FSDP2 ws=2 -> ws=3 and -> 1 process, the workers of the S3 and local
resharding tests), the CLI, tiering from ``shm://``, parallel composite uploads and ranged reads,
the retry classification on a dead server and on permanent errors, and the server killed in the
middle of a save (the previous checkpoint still loads, the partial one is invisible).

What the emulator cannot express, so is not tested here: bad credentials / no permission (it
has no IAM: every request is allowed), 429 / 503 answers (it never throttles), and the
``ifGenerationMatch=0`` of resumable uploads and of compose (it ignores those two; a large
``write`` therefore also checks the name is free before its parts go up)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest
import torch

import unickpt
from tests.fixtures.contract import pattern
from tests.unit.storage.test_tiering import _model, _values, fast_root  # noqa: F401 (a fixture)
from tests.workers.harness import run_ranks
from tests.workers.reshard_workers import check, load_phase, save_phase
from tests.workers.s3_workers import tiny
from unickpt.errors import StorageError
from unickpt.format.records import METADATA_FILE
from unickpt.storage import DEFAULT_REGISTRY, RetryPolicy, StorageOptions, open_storage
from unickpt.storage.gcs import PART_MARK, GcsStorage
from unickpt.storage.shm import shm_base


@pytest.mark.parametrize("dst_ws", [3, 1])
def test_issue42_gcs_fsdp2_reshard_bit_exact(gcs_bucket, dst_ws):
    url = gcs_bucket.url(f"reshard/to{dst_ws}")
    saved = run_ranks(save_phase, 2, "fsdp2", url)
    ref = dict(saved[0])
    check(run_ranks(load_phase, dst_ws, "fsdp2", url, ref), ref, 2)


def test_issue42_gcs_cli_ls_inspect_verify_prune(gcs_bucket):
    root = gcs_bucket.url("cli")
    manager = unickpt.CheckpointManager(root, keep_last=None)
    model, optim = tiny(7)
    for step in (1, 2):
        manager.save(step, {"model": model, "optimizer": optim})

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "unickpt.cli", *args], capture_output=True, text=True, timeout=120)

    ls = cli("ls", root)
    assert ls.returncode == 0 and ls.stdout.count("step ") == 2, ls.stdout + ls.stderr
    inspected = cli("inspect", manager.path_for(2))
    assert inspected.returncode == 0 and "0.weight" in inspected.stdout, inspected.stdout + inspected.stderr
    assert cli("verify", manager.path_for(2)).returncode == 0
    pruned = cli("prune", root, "--keep-last", "1")
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert [c.step for c in manager.list_checkpoints()] == [2]
    assert not any(n.startswith("step_00000001/") for n in open_storage(root).list())


def test_issue42_tiering_shm_to_gcs(gcs_bucket, fast_root):  # noqa: F811 (a fixture)
    tiers = unickpt.TieredCheckpointManager(fast_root, gcs_bucket.url("job"), keep_fast=1)
    model = _model(3)
    for step in (1, 2):
        with torch.no_grad():
            model[1].weight.mul_(2.0)
        tiers.save(step, {"model": model})
    tiers.wait()
    assert [c.step for c in tiers.durable.list_checkpoints()] == [1, 2]
    shutil.rmtree(os.path.join(shm_base(), fast_root[len("shm://") :]))
    fresh = _model(8)
    assert tiers.load_latest({"model": fresh}) == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in _values(model).items())
    tiers.close()


def test_issue42_gcs_large_write_is_a_parallel_composite_upload_read_in_ranges(gcs_bucket):
    options = StorageOptions(part_size=5 << 20, max_concurrency=4)
    s = open_storage(gcs_bucket.url("big"), options)
    data = pattern((12 << 20) + 7, 1)  # 3 parts
    views = [memoryview(data)[: 1 << 20], memoryview(data)[1 << 20 :]]
    s.write("data/x/r00000-00.bin", views)
    assert s.list() == ["data/x/r00000-00.bin"]  # composed; no part left behind
    assert not any(PART_MARK in n for n in open_storage(gcs_bucket.url()).list())
    assert s.size("data/x/r00000-00.bin") == len(data)
    out = bytearray(len(data) - 100)
    s.read_into("data/x/r00000-00.bin", 50, memoryview(out))  # 3 ranged requests at once
    assert out == data[50:-50]
    with pytest.raises(StorageError) as ei:
        s.write("data/x/r00000-00.bin", views)
    assert ei.value.errno == errno.EEXIST
    assert s.list() == ["data/x/r00000-00.bin"]


def test_issue42_gcs_errors_missing_bucket_and_permanent_ones_are_not_retried(gcs_bucket):
    policy = RetryPolicy(max_attempts=3, initial_delay_s=0.01, jitter=0.0)
    missing = open_storage("gs://no-such-bucket-42/ck", StorageOptions(retry=policy))
    with pytest.raises(StorageError) as ei:
        missing.list()
    assert ei.value.errno == errno.ENOENT and "no-such-bucket-42" in str(ei.value) and "1 attempt" not in str(ei.value)
    with pytest.raises(StorageError) as ei:
        unickpt.save("gs://no-such-bucket-42/ck", {"model": _model(1)})
    assert "no-such-bucket-42" in str(ei.value)


def test_issue42_gcs_dead_server_is_retried_with_backoff_then_named(gcs_bucket, gcs_server):
    policy = RetryPolicy(max_attempts=3, initial_delay_s=0.01, jitter=0.0)
    s = open_storage(gcs_bucket.url("dead"), StorageOptions(retry=policy))
    s.put("a", b"1")
    gcs_server.kill()
    try:
        with pytest.raises(StorageError) as ei:
            s.read("a")
        assert ei.value.errno == errno.ECONNRESET and "cannot reach the server" in str(ei.value)
        assert "3 attempt" in str(ei.value) and gcs_bucket.url("dead/a") in str(ei.value), str(ei.value)
    finally:
        gcs_server.start()
    assert s.read("a") == b"1"  # the restarted server serves the same objects


def test_issue42_gcs_server_killed_mid_save_keeps_the_previous_checkpoint(gcs_bucket, gcs_server, monkeypatch):
    root = gcs_bucket.url("crash")
    model, optim = tiny(3)
    manager = unickpt.CheckpointManager(root, keep_last=3)
    manager.save(1, {"model": model, "optimizer": optim})
    want = {k: v.clone() for k, v in model.state_dict().items()}

    class KilledMidUpload(GcsStorage):
        def write(self, name, parts):  # the server dies as the first data object goes up
            gcs_server.kill()
            super().write(name, parts)

    monkeypatch.setattr(DEFAULT_REGISTRY, "_entries", dict(DEFAULT_REGISTRY._entries))
    DEFAULT_REGISTRY.register("gs", KilledMidUpload, replace=True)
    fast = StorageOptions(retry=RetryPolicy(max_attempts=2, initial_delay_s=0.01, jitter=0.0))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    try:
        with pytest.raises(unickpt.CheckpointError):
            manager.save(2, {"model": model, "optimizer": optim}, options=unickpt.SaveOptions(storage=fast))
    finally:
        DEFAULT_REGISTRY.register("gs", GcsStorage, replace=True)
        gcs_server.start()
    manager = unickpt.CheckpointManager(root, keep_last=3)
    assert [c.step for c in manager.list_checkpoints()] == [1]
    assert METADATA_FILE not in open_storage(manager.path_for(2)).list()
    fresh, fresh_optim = tiny(9)
    assert manager.load_latest({"model": fresh, "optimizer": fresh_optim}) == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
