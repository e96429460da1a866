"""unickpt checkpoints on ``gs://`` and ``az://`` against real emulators started by the tests
(fake-gcs-server, ``gcsserver.py``; Azurite, ``azurite.py``; ``STORAGE_EMULATOR_HOST`` /
``AZURE_STORAGE_CONNECTION_STRING`` reach the spawned ranks through the environment), each test
parametrised over both: resharding bit for bit (FSDP2 ws=2 -> ws=3 and -> 1 process, the workers
of the S3 and local resharding tests), the CLI, tiering from ``shm://``, parallel composite /
block uploads and ranged reads, the retry classification on a dead server and on permanent
errors, and the server killed in the middle of a save (the previous checkpoint still loads, the
partial one is invisible).

What the emulators cannot express, so is not tested here: 429 / 503 answers (neither throttles);
on fake-gcs-server also 401 / 403 (no IAM) and the ``ifGenerationMatch=0`` of resumable uploads
and of compose (ignored by it; a large GCS ``write`` also checks that the name is free before
its parts go up). Azurite checks keys and SAS permissions: bad credentials and a read-only
identity are tested on ``az://``."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import torch

import unickpt
from tests.fixtures.contract import pattern
from tests.unit.test_tiering import _model, _values, fast_root  # noqa: F401 (a fixture)
from tests.workers.harness import run_ranks
from tests.workers.rel_workers import locked_save_worker
from tests.workers.reshard_workers import check, load_phase, save_phase
from tests.workers.s3_workers import tiny
from unickpt.errors import StorageError
from unickpt.format.records import METADATA_FILE
from unickpt.storage import DEFAULT_REGISTRY, RetryPolicy, StorageOptions, open_storage
from unickpt.storage.shm import shm_base


@dataclass(frozen=True)
class Cloud:
    """One emulated service as the tests use it: URLs of a fresh bucket/container, its server
    (``kill`` / ``start``), the backend class, and a URL for a bucket that does not exist."""

    scheme: str
    url: Callable[[str], str]
    server: Any
    backend: type
    missing_url: str


@pytest.fixture(params=["gs", "az"])
def cloud(request) -> Cloud:
    if request.param == "gs":
        from unickpt.storage.gcs import GcsStorage

        b = request.getfixturevalue("gcs_bucket")
        return Cloud("gs", b.url, b.server, GcsStorage, "gs://no-such-bucket-42/ck")
    from unickpt.storage.azure import AzureBlobStorage

    c = request.getfixturevalue("az_container")
    return Cloud("az", c.url, c.server, AzureBlobStorage, "az://no-such-container-42/ck")


@pytest.mark.parametrize("dst_ws", [3, 1])
def test_issue42_cloud_fsdp2_reshard_bit_exact(cloud, dst_ws):
    url = cloud.url(f"reshard/to{dst_ws}")
    saved = run_ranks(save_phase, 2, "fsdp2", url)
    ref = dict(saved[0])
    check(run_ranks(load_phase, dst_ws, "fsdp2", url, ref), ref, 2)


def test_issue42_cloud_cli_ls_inspect_verify_prune(cloud):
    root = cloud.url("cli")
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


def test_issue42_tiering_shm_to_cloud(cloud, fast_root):  # noqa: F811 (a fixture)
    tiers = unickpt.TieredCheckpointManager(fast_root, cloud.url("job"), keep_fast=1)
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


def test_issue42_cloud_large_write_is_a_parallel_upload_read_in_ranges(cloud):
    """gs: parts composed into the file, then deleted; az: blocks staged, committed in one list."""
    options = StorageOptions(part_size=5 << 20, max_concurrency=4)
    s = open_storage(cloud.url("big"), options)
    data = pattern((12 << 20) + 7, 1)  # 3 parts
    views = [memoryview(data)[: 1 << 20], memoryview(data)[1 << 20 :]]
    s.write("data/x/r00000-00.bin", views)
    assert s.list() == ["data/x/r00000-00.bin"]  # composed; no part left behind
    assert open_storage(cloud.url()).list() == ["big/data/x/r00000-00.bin"]  # no part objects left
    assert s.size("data/x/r00000-00.bin") == len(data)
    out = bytearray(len(data) - 100)
    s.read_into("data/x/r00000-00.bin", 50, memoryview(out))  # 3 ranged requests at once
    assert out == data[50:-50]
    with pytest.raises(StorageError) as ei:
        s.write("data/x/r00000-00.bin", views)
    assert ei.value.errno == errno.EEXIST
    assert s.list() == ["data/x/r00000-00.bin"]


def test_issue42_cloud_errors_missing_bucket_and_permanent_ones_are_not_retried(cloud):
    policy = RetryPolicy(max_attempts=3, initial_delay_s=0.01, jitter=0.0)
    missing = open_storage(cloud.missing_url, StorageOptions(retry=policy))
    name = cloud.missing_url.split("/")[2]
    with pytest.raises(StorageError) as ei:
        missing.list()
    assert ei.value.errno == errno.ENOENT and name in str(ei.value) and "attempt" not in str(ei.value), str(ei.value)
    with pytest.raises(StorageError) as ei:
        unickpt.save(cloud.missing_url, {"model": _model(1)})
    assert name in str(ei.value) and "create" in str(ei.value)


def test_issue42_azure_bad_key_and_read_only_identity_fail_at_once_naming_the_credentials(az_container):
    """Azurite checks the shared key and SAS permissions: a wrong key (403 AuthenticationFailed)
    and a read-only SAS writing (403 AuthorizationPermissionMismatch) are EACCES, not retried."""
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from tests.fixtures.azurite import ACCOUNT, DEV_KEY

    server = az_container.server
    policy = RetryPolicy(max_attempts=3, initial_delay_s=0.01, jitter=0.0)
    url = az_container.url("auth")
    open_storage(url).put("a", b"1")
    wrong = "A" * 86 + "=="
    bad = open_storage(
        url, StorageOptions(retry=policy, client_options={"connection_string": server.connection_string(wrong)})
    )
    with pytest.raises(StorageError) as ei:
        bad.read("a")
    assert ei.value.errno == errno.EACCES and "credentials" in str(ei.value) and "attempt" not in str(ei.value)
    sas = generate_container_sas(
        ACCOUNT,
        az_container.name,
        account_key=DEV_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.now(UTC) + timedelta(hours=1),
    )
    reader = open_storage(
        url, StorageOptions(retry=policy, client_options={"account_url": server.blob_endpoint, "credential": sas})
    )
    assert reader.read("a") == b"1" and reader.list() == ["a"]
    with pytest.raises(StorageError) as ei:
        reader.put("b", b"2")
    assert ei.value.errno == errno.EACCES and "attempt" not in str(ei.value), str(ei.value)
    assert open_storage(url).list() == ["a"]


def test_issue42_cloud_dead_server_is_retried_with_backoff_then_named(cloud):
    policy = RetryPolicy(max_attempts=3, initial_delay_s=0.01, jitter=0.0)
    s = open_storage(cloud.url("dead"), StorageOptions(retry=policy))
    s.put("a", b"1")
    cloud.server.kill()
    try:
        with pytest.raises(StorageError) as ei:
            s.read("a")
        assert ei.value.errno == errno.ECONNRESET and "cannot reach the server" in str(ei.value)
        assert "3 attempt" in str(ei.value) and cloud.url("dead/a") in str(ei.value), str(ei.value)
    finally:
        cloud.server.start()
    assert s.read("a") == b"1"  # the restarted server serves the same objects


def test_issue42_cloud_server_killed_mid_save_keeps_the_previous_checkpoint(cloud, monkeypatch):
    root = cloud.url("crash")
    model, optim = tiny(3)
    manager = unickpt.CheckpointManager(root, keep_last=3)
    manager.save(1, {"model": model, "optimizer": optim})
    want = {k: v.clone() for k, v in model.state_dict().items()}

    class KilledMidUpload(cloud.backend):  # type: ignore[name-defined,misc]
        def write(self, name, parts):  # the server dies as the first data object goes up
            cloud.server.kill()
            super().write(name, parts)

    monkeypatch.setattr(DEFAULT_REGISTRY, "_entries", dict(DEFAULT_REGISTRY._entries))
    DEFAULT_REGISTRY.register(cloud.scheme, KilledMidUpload, replace=True)
    fast = StorageOptions(retry=RetryPolicy(max_attempts=2, initial_delay_s=0.01, jitter=0.0))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    try:
        with pytest.raises(unickpt.CheckpointError):
            manager.save(2, {"model": model, "optimizer": optim}, options=unickpt.SaveOptions(storage=fast))
    finally:
        DEFAULT_REGISTRY.register(cloud.scheme, cloud.backend, replace=True)
        cloud.server.start()
    manager = unickpt.CheckpointManager(root, keep_last=3)
    assert [c.step for c in manager.list_checkpoints()] == [1]
    assert METADATA_FILE not in open_storage(manager.path_for(2)).list()
    fresh, fresh_optim = tiny(9)
    assert manager.load_latest({"model": fresh, "optimizer": fresh_optim}) == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())


def test_issue42_cloud_two_savers_never_both_commit(cloud):
    """A save held at its commit (an event listener waiting on a threading.Event) owns the save
    lock, an exclusive create on the service; a second job (another process, its own client)
    saving to the same checkpoint is refused with the holder named and writes no metadata; the
    first save then commits and its state is what loads."""
    url = cloud.url("race/step_1")
    model, optim = tiny(11)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    at_commit, go_on = threading.Event(), threading.Event()

    def hold(ev) -> None:
        if ev.phase == "save.commit.begin":
            at_commit.set()
            go_on.wait(120)

    events = unickpt.default_checkpointer().events
    events.add_listener(hold)
    outcome: list[object] = []
    first = threading.Thread(target=lambda: outcome.append(unickpt.save(url, {"model": model, "optimizer": optim})))
    first.start()
    try:
        assert at_commit.wait(120)
        second = run_ranks(locked_save_worker, 1, url)[0]
        assert second["type"] == "ConcurrentSaveError", second
        assert METADATA_FILE not in open_storage(url).list()
    finally:
        go_on.set()
        first.join(120)
        events.remove_listener(hold)
    assert len(outcome) == 1 and METADATA_FILE in open_storage(url).list()
    fresh, fresh_optim = tiny(12)
    unickpt.load(url, {"model": fresh, "optimizer": fresh_optim})
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
