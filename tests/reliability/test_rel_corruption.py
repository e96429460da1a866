"""Corrupt checkpoints loaded by two ranks: every rank raises a CheckpointError, and the report
names the rank that found the problem and the file. Plus the one-process catalogue of corruption
kinds, each with its own error type."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import unickpt
from tests.workers.harness import run_ranks
from tests.workers.rel_helpers import tiny_model
from tests.workers.rel_workers import corrupt_load_worker, fsdp2_save_worker
from unickpt.format import decode_metadata
from unickpt.format.records import FORMAT_VERSION, METADATA_FILE
from unickpt.testing.toy import build

KINDS = ["flip", "truncate", "delete", "metadata"]


def _rank1_file(ckpt: str) -> tuple[str, int]:
    """A data file written by rank 1 and the byte offset of the middle of one of its shards."""
    md = decode_metadata(open(os.path.join(ckpt, METADATA_FILE), "rb").read())
    for t in md.tensors.values():
        for s in t.shards:
            if "/r00001-" in md.files[s.file_index] and s.byte_length >= 64:
                return md.files[s.file_index], s.byte_offset + s.byte_length // 2
    raise AssertionError("rank 1 wrote no shard")


def _damage(ckpt: str, kind: str) -> str:
    """Damage one file of rank 1 (or the metadata); return the damaged data file's name."""
    name, at = _rank1_file(ckpt)
    path = os.path.join(ckpt, name)
    if kind == "flip":
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x40]))
    elif kind == "truncate":
        os.truncate(path, at)
    elif kind == "delete":
        os.unlink(path)
    else:
        meta = os.path.join(ckpt, METADATA_FILE)
        os.truncate(meta, os.path.getsize(meta) // 2)
    return name


@pytest.fixture(scope="module")
def two_rank_loads(tmp_path_factory):
    """One 2-rank fsdp2 save, four damaged copies, all loaded by one 2-rank job:
    kind -> (checkpoint, damaged file, [rank 0 report, rank 1 report])."""
    base = tmp_path_factory.mktemp("corrupt")
    ckpt = str(base / "ck")
    run_ranks(fsdp2_save_worker, 2, ckpt)
    copies, names = [], []
    for kind in KINDS:
        copy = str(base / kind)
        shutil.copytree(ckpt, copy)
        names.append(_damage(copy, kind))
        copies.append(copy)
    res = run_ranks(corrupt_load_worker, 2, copies)
    return {kind: (copies[i], names[i], [res[0][i], res[1][i]]) for i, kind in enumerate(KINDS)}


@pytest.mark.parametrize("kind", KINDS)
def test_two_rank_load_of_a_corrupt_checkpoint(two_rank_loads, kind):
    ckpt, name, res = two_rank_loads[kind]
    assert not any(r["ok"] for r in res), res
    types = [r["type"] for r in res]
    assert all(not t.startswith("NOT A") for t in types), res
    expected = {
        "flip": "ChecksumMismatchError",
        "truncate": "TruncatedDataFileError",
        "delete": "MissingDataFileError",
        "metadata": "CorruptMetadataError",
    }[kind]
    if kind == "metadata":  # rank 0 reads it, every rank raises the same precise error
        assert types == [expected, expected], res
        assert all(f"{ckpt}/{METADATA_FILE}" in r["msg"] for r in res)
        return
    # the rank that read the bad file raises the precise error; the other gets the report naming
    # that rank, the stage and the file (when both ranks read it, both get that report)
    assert expected in types or types == ["RankFailures", "RankFailures"], res
    for r in res:
        assert name.rsplit("/", 1)[1] in r["msg"], r
        if r["type"] == "RankFailures":
            assert "load" in r["msg"] and f": {expected}: rank " in r["msg"], r
        else:
            assert r["type"] == expected and r["msg"].startswith("rank "), r


def _one_process_ckpt(tmp_path) -> tuple[str, dict]:
    model, optim = tiny_model()
    ckpt = str(tmp_path / "ck")
    unickpt.save(ckpt, {"model": model, "optimizer": optim, "extra_state": {"step": 1}}, framework="torch")
    return ckpt, json.loads(open(os.path.join(ckpt, METADATA_FILE), "rb").read())


def _corrupt(ckpt: str, md: dict, kind: str) -> None:
    meta = os.path.join(ckpt, METADATA_FILE)
    data = os.path.join(ckpt, md["files"][0])
    if kind == "flipped data byte":
        t = md["tensors"]["model.0.weight"]
        boff = t["shards"][0][2 * len(t["shape"]) + 1]
        with open(data, "r+b") as f:
            f.seek(boff + 3)
            b = f.read(1)
            f.seek(boff + 3)
            f.write(bytes([b[0] ^ 1]))
    elif kind == "truncated data file":
        os.truncate(data, 8)
    elif kind == "missing data file":
        os.unlink(data)
    elif kind == "garbage metadata":
        open(meta, "wb").write(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    elif kind == "truncated metadata":
        os.truncate(meta, os.path.getsize(meta) - 7)
    elif kind == "future format version":
        md = dict(md, format_version=FORMAT_VERSION + 1)
        open(meta, "w").write(json.dumps(md))
    elif kind == "another tool's folder":
        shutil.rmtree(ckpt)
        os.makedirs(ckpt)
        open(os.path.join(ckpt, "pytorch_model.bin"), "wb").write(b"PK\x03\x04")
    elif kind == "interrupted save":
        os.unlink(meta)
    else:
        raise ValueError(kind)


@pytest.mark.parametrize(
    "kind,error,words",
    [
        ("flipped data byte", unickpt.ChecksumMismatchError, ["model.0.weight", "checksum mismatch"]),
        ("truncated data file", unickpt.TruncatedDataFileError, ["truncated", ".bin"]),
        ("missing data file", unickpt.MissingDataFileError, ["missing", ".bin"]),
        ("garbage metadata", unickpt.CorruptMetadataError, ["not valid JSON", METADATA_FILE]),
        ("truncated metadata", unickpt.CorruptMetadataError, ["not valid JSON", METADATA_FILE]),
        ("future format version", unickpt.UnsupportedFormatVersionError, ["version", "Upgrade"]),
        ("another tool's folder", unickpt.NotACheckpointError, ["not a unickpt checkpoint"]),
        ("interrupted save", unickpt.IncompleteCheckpointError, ["interrupted"]),
    ],
)
def test_each_corruption_has_its_own_error(tmp_path, kind, error, words):
    ckpt, md = _one_process_ckpt(tmp_path)
    _corrupt(ckpt, md, kind)
    model, optim = tiny_model(seed=5)
    with pytest.raises(unickpt.CheckpointError) as ei:
        unickpt.load(ckpt, {"model": model, "optimizer": optim, "extra_state": None}, framework="torch")
    assert type(ei.value) is error, (type(ei.value), ei.value)
    msg = str(ei.value)
    assert ckpt in msg and all(w in msg for w in words), msg
    # the error is the whole story: no foreign exception chained under it
    cause = ei.value.__cause__ or (None if ei.value.__suppress_context__ else ei.value.__context__)
    assert cause is None or isinstance(cause, unickpt.CheckpointError), repr(cause)
    mgr = unickpt.CheckpointManager(str(tmp_path))
    assert mgr.list_checkpoints() == []  # "ck" is no step folder; also nothing crashes


def test_wrong_model_is_refused_before_reading(tmp_path):
    ckpt, _ = _one_process_ckpt(tmp_path)
    model, optim = build("torch")
    with pytest.raises((unickpt.ShapeMismatchError, unickpt.MissingKeysError, unickpt.UnexpectedKeysError)):
        unickpt.load(ckpt, {"model": model, "optimizer": optim}, framework="torch")
