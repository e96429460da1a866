"""The resharding, crash and corruption tests of local disks, run again on ``s3://`` (a real
SeaweedFS server on loopback, ``s3server.py``): the same gloo workers, the same expectations.

- FSDP2 ws=4 -> FSDP2 ws=2 and DDP ws=2 -> FSDP2 ws=4: bit-exact model, optimizer, param groups,
  extra state and the same next-step loss as the uninterrupted run (``reshard_workers``).
- A rank SIGKILLed while it writes its data objects, before the commit, or (coordinator) entering
  the metadata publication (a ``put`` on S3): the previous checkpoint loads bit-exact, the
  partial one is refused precisely, ``latest`` does not move, and the next job's save succeeds.
- A flipped byte, a truncated and a deleted data object, a truncated metadata object: every rank
  of a 2-rank load raises the precise error naming the object.

Endpoint and credentials reach the ranks through the standard ``AWS_*`` variables.
"""

from __future__ import annotations

import pytest
import torch

import unickpt
from tests.workers.harness import launch_ranks, run_ranks
from tests.workers.rel_helpers import mismatches, snapshot
from tests.workers.rel_workers import corrupt_load_worker, crash_worker, fsdp2_save_worker
from tests.workers.reshard_workers import check, load_phase, save_phase
from unickpt.folder.lock import LOCK_FILE
from unickpt.format.records import METADATA_FILE
from unickpt.storage import open_storage
from unickpt.testing.toy import build, train_step


@pytest.fixture
def aws_env(s3_bucket, monkeypatch):
    for k, v in s3_bucket.endpoint.env().items():
        monkeypatch.setenv(k, v)
    return s3_bucket


@pytest.mark.parametrize("src,src_ws,dst,dst_ws", [("fsdp2", 4, "fsdp2", 2), ("ddp", 2, "fsdp2", 4)])
def test_issue14_reshard_bit_exact_over_s3(aws_env, src, src_ws, dst, dst_ws):
    url = f"s3://{aws_env.name}/reshard/{src}-{src_ws}"
    saved = run_ranks(save_phase, src_ws, src, url)
    ref = dict(saved[0])
    results = run_ranks(load_phase, dst_ws, dst, url, ref)
    check(results, ref, src_ws)


CRASHES = [
    ("save.write.file", 1, False),  # rank 1 uploaded its first data object
    ("save.commit.begin", 1, True),  # every rank wrote, over a committed checkpoint
    ("commit.enter", 0, True),  # the coordinator dies entering the metadata put
]


def _fresh_state() -> dict:
    model, optim = build("torch", seed=1234)
    return {"model": model, "optimizer": optim, "extra_state": None}


@pytest.mark.parametrize(
    "fault,victim,same_path", CRASHES, ids=[f"{f}-rank{v}-{'same' if s else 'new'}" for f, v, s in CRASHES]
)
def test_issue14_killed_rank_over_s3_leaves_previous_checkpoint(aws_env, tmp_path, fault, victim, same_path):
    root, same = f"s3://{aws_env.name}/run", f"s3://{aws_env.name}/same"
    snap_file = str(tmp_path / "snap.pt")
    outcomes = launch_ranks(crash_worker, 2, root, same, fault, victim, same_path, snap_file, victim=victim, grace=5.0)
    assert outcomes[victim].status == "killed" and outcomes[victim].exitcode == -9, outcomes
    assert outcomes[1 - victim].status in ("killed", "error"), outcomes
    ref = torch.load(snap_file, weights_only=True)

    manager = unickpt.CheckpointManager(root, keep_last=3)
    assert [c.step for c in manager.list_checkpoints()] == [1]
    assert manager.read_pointer().step == 1
    state = _fresh_state()
    assert manager.load_latest(state, framework="torch") == 1
    assert not mismatches(snapshot(state["model"], state["optimizer"]), ref)
    if same_path:
        state = _fresh_state()
        unickpt.load(same, state, framework="torch")  # the committed object set, untouched
        assert not mismatches(snapshot(state["model"], state["optimizer"]), ref)
        assert state["extra_state"] == {"step": 1}
    else:
        target = manager.path_for(2)
        assert METADATA_FILE not in open_storage(target).list()
        with pytest.raises((unickpt.IncompleteCheckpointError, unickpt.NotACheckpointError)) as ei:
            unickpt.load(target, _fresh_state(), framework="torch")
        assert target in str(ei.value)

    # the next job saves over the same places (breaking the dead coordinator's stale lock)
    model, optim = build("torch", seed=0)
    train_step(model, optim, 0)
    new_state = {"model": model, "optimizer": optim, "extra_state": {"step": 3}}
    if same_path:
        unickpt.save(same, new_state, framework="torch")
        names = open_storage(same).list()
        assert LOCK_FILE not in names, names
        back = _fresh_state()
        unickpt.load(same, back, framework="torch")
        assert not mismatches(snapshot(back["model"], back["optimizer"]), snapshot(model, optim))
    manager.save(3, new_state, framework="torch")
    assert [c.step for c in manager.list_checkpoints()] == [1, 3]
    assert manager.read_pointer().step == 3


def _damage(url: str, kind: str) -> str:
    """Damage one object of ``url``'s checkpoint written by rank 1 (or the metadata); S3 objects
    cannot be edited, so the damaged version replaces the object. Returns the object's name."""
    storage = open_storage(url)
    if kind == "metadata":
        data = storage.read(METADATA_FILE)
        storage.put(METADATA_FILE, data[: len(data) // 2])
        return METADATA_FILE
    name = next(n for n in storage.list("data/") if "/r00001-" in n)
    data = bytearray(storage.read(name))
    storage.delete([name])
    if kind == "flip":
        data[len(data) // 2] ^= 0x40
        storage.put(name, bytes(data))
    elif kind == "truncate":
        storage.put(name, bytes(data[: len(data) // 2]))
    return name


def test_issue14_corrupt_objects_on_s3_give_precise_errors_on_every_rank(aws_env):
    kinds = {
        "flip": "ChecksumMismatchError",
        "truncate": "TruncatedDataFileError",
        "delete": "MissingDataFileError",
        "metadata": "CorruptMetadataError",
    }
    urls, names = [], []
    for kind in kinds:
        url = f"s3://{aws_env.name}/corrupt/{kind}"
        run_ranks(fsdp2_save_worker, 2, url)
        names.append(_damage(url, kind))
        urls.append(url)
    res = run_ranks(corrupt_load_worker, 2, urls)
    for i, (kind, expected) in enumerate(kinds.items()):
        reports = [res[0][i], res[1][i]]
        assert not any(r["ok"] for r in reports), (kind, reports)
        types = [r["type"] for r in reports]
        assert all(not t.startswith("NOT A") for t in types), (kind, reports)
        if kind == "metadata":
            assert types == [expected, expected], reports
            assert all(f"{urls[i]}/{METADATA_FILE}" in r["msg"] for r in reports), reports
            continue
        assert expected in types or types == ["RankFailures", "RankFailures"], (kind, reports)
        for r in reports:
            assert names[i].rsplit("/", 1)[1] in r["msg"], (kind, r)
            if r["type"] == "RankFailures":
                assert f": {expected}: rank " in r["msg"], (kind, r)
