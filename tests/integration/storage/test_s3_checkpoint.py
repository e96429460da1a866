"""unickpt checkpoints on a real S3 server (SeaweedFS, ``s3server.py``): saved by 2 gloo ranks,
loaded at another world size bit for bit, managed by ``CheckpointManager``, inspected, and a
throttling server fails a save with an error naming the file, the stage and the rank.

Endpoint and credentials travel in the standard variables (``AWS_ENDPOINT_URL`` ...), as a job
would give them; expected tensors come from plain torch (``support.reference``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import unickpt
from tests.support.reference import full_state
from tests.workers.harness import run_ranks
from tests.workers.s3_workers import load_and_compare, save_replicated, tiny
from unickpt.errors import CheckpointError, StorageError
from unickpt.storage import RetryPolicy, StorageOptions, open_storage


@pytest.fixture
def aws_env(s3_bucket, monkeypatch):
    for k, v in s3_bucket.endpoint.env().items():
        monkeypatch.setenv(k, v)
    return s3_bucket


def test_issue14_s3_checkpoint_saved_by_two_ranks_loads_at_one_and_three(aws_env):
    url = f"s3://{aws_env.name}/run/step_1"
    paths = run_ranks(save_replicated, 2, url, 3)
    assert paths == [url, url]
    names = open_storage(url).list()
    assert "unickpt.metadata.json" in names and not any("lock" in n for n in names), names
    assert run_ranks(load_and_compare, 1, url, 3) == [[]]
    assert run_ranks(load_and_compare, 3, url, 3) == [[], [], []]


def test_issue14_manager_and_inspect_on_an_s3_root(aws_env, capsys):
    root = f"s3://{aws_env.name}/jobs/a"
    model, optim = tiny(5)
    state = {"model": model, "optimizer": optim}
    manager = unickpt.CheckpointManager(root, keep_last=2)
    expected = {}
    for step in (1, 2, 3):
        optim.param_groups[0]["lr"] = 0.001 * step
        with torch.no_grad():
            model[0].bias.add_(1.0)
        expected[step] = full_state(model, optim)
        handle = manager.save(step, state, async_save=(step == 2))
        handle.wait_snapshot()  # the next in-place change happens outside optimizer.step()
    manager.wait()
    kept = sorted({n.split("/")[0] for n in open_storage(root).list()})
    assert kept == ["latest", "step_00000002", "step_00000003"], kept
    fresh_model, fresh_optim = tiny(6)
    fresh = {"model": fresh_model, "optimizer": fresh_optim}
    assert manager.load_latest(fresh) == 3
    got = full_state(fresh_model, fresh_optim)
    assert all(torch.equal(got[k], expected[3][k]) for k in expected[3]) and set(got) == set(expected[3])
    out = subprocess.run(
        [sys.executable, "-m", "unickpt.cli", "inspect", f"{root}/step_00000003", "--verify"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0.weight" in out.stdout


def test_issue14_throttling_server_fails_the_save_naming_file_stage_and_rank(aws_env, s3_server):
    """SeaweedFS's circuit breaker answers every write with 503 (a real throttling server): the
    save retries under its policy, then fails with a StorageError naming the object, the stage
    and the rank, and commits nothing; reads keep working, and the next save succeeds."""
    url = f"s3://{aws_env.name}/throttled/step_1"
    model, optim = tiny(1)
    retry = RetryPolicy(max_attempts=3, initial_delay_s=0.01, jitter=0.0)
    options = unickpt.SaveOptions(storage=StorageOptions(retry=retry))
    s3_server.shell("s3.circuitBreaker -global -type Count -actions Write -values 0 -apply")
    try:
        with pytest.raises(CheckpointError) as ei:
            unickpt.save(url, {"model": model, "optimizer": optim}, options=options)
    finally:
        s3_server.shell("s3.circuitBreaker -global -disable -apply")
    err = ei.value
    text = str(err)
    assert isinstance(err, StorageError), repr(err)
    assert "rank 0, lock" in text and url in text and "3 attempt" in text, text
    assert "ErrTooManyRequest" in text or "503" in text, text
    assert "unickpt.metadata.json" not in open_storage(url).list()
    unickpt.save(url, {"model": model, "optimizer": optim})
    assert "unickpt.metadata.json" in open_storage(url).list()


def test_issue14_listing_pages_past_1000_keys_through_unickpt(s3_bucket):
    """S3Storage.list follows continuation tokens (pages of at most 1000 keys)."""
    from unickpt.storage.retry import unwrap
    from unickpt.storage.s3 import S3Storage

    options = StorageOptions(client_options=s3_bucket.storage_options())
    s3 = unwrap(open_storage(f"s3://{s3_bucket.name}/many", options))
    assert isinstance(s3, S3Storage)
    client = s3_bucket.endpoint.client()
    names = [f"k/{i:05d}" for i in range(1005)]
    for name in names:
        client.put_object(Bucket=s3_bucket.name, Key=f"many/{name}", Body=b"x")
    assert s3.list("k/") == names
    s3.delete(names)
    assert s3.list("k/") == []


def test_issue14_cli_on_an_s3_root(aws_env, tmp_path):
    root = f"s3://{aws_env.name}/cli"
    manager = unickpt.CheckpointManager(root, keep_last=None)
    model, optim = tiny(7)
    for step in (1, 2):
        manager.save(step, {"model": model, "optimizer": optim})

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "unickpt.cli", *args], capture_output=True, text=True, timeout=120)

    ls = cli("ls", root)
    assert ls.returncode == 0 and ls.stdout.count("step ") == 2, ls.stdout + ls.stderr
    latest = cli("latest", root)
    assert latest.returncode == 0 and latest.stdout.strip() == manager.path_for(2)
    assert cli("verify", manager.path_for(2)).returncode == 0
    merged = cli("merge", manager.path_for(2), str(tmp_path / "out"), "--model-only")
    assert merged.returncode == 0 and (tmp_path / "out" / "model.safetensors").exists(), merged.stderr
    pruned = cli("prune", root, "--keep-last", "1")
    assert pruned.returncode == 0 and [c.step for c in manager.list_checkpoints()] == [2]
