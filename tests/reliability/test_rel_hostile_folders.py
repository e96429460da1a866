"""Hostile or foreign folders (issue 9, items 2, 8, 9, 11): unickpt deletes and overwrites only what
it wrote, never follows a link it did not make, reads only regular files with a size cap, and
refuses sizes that metadata claims before allocating them.

Every case that could hang (a FIFO) or grow memory without bound (``/dev/zero``, a 64 GiB sparse
file) runs in a child process whose address space is capped, each operation in a thread with a
deadline, so a regression fails the test instead of hanging or swapping the machine."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import textwrap

import crc32c
import pytest

import unickpt
from tests.workers.harness import run_ranks
from tests.workers.rel_helpers import data_files, mismatches, snapshot, tiny_model
from tests.workers.rel_workers import locked_save_worker
from unickpt.format.records import METADATA_FILE
from unickpt.planning.save.model import data_path, file_name


def _state(seed: int = 0) -> dict:
    model, optim = tiny_model(seed=seed)
    return {"model": model, "optimizer": optim, "extra_state": {"seed": seed}}


def _save(path: str, seed: int = 0) -> str:
    md = unickpt.save(path, _state(seed), framework="torch").wait()
    assert md is not None
    return md.save_id


def _tree(folder) -> dict[str, bytes]:
    """Every regular file under ``folder`` with its bytes."""
    return {n: open(os.path.join(folder, n), "rb").read() for n in data_files(str(folder))}


# ----------------------------------------------------------------------------- item 2


def test_item2_save_refuses_a_foreign_folder_and_deletes_nothing(tmp_path):
    """A folder that holds a ``data/`` of the user's (or any file) and nothing of unickpt's is
    refused before anything is written: no lock, no marker, no data, the user's files intact."""
    cases = {
        "data folder": {"data/mine.txt": b"precious", "data/sub/x.bin": b"\x01\x02"},
        "top-level file": {"notes.txt": b"hello"},
        "unrelated sub-folder": {"runs/a/log.txt": b"log"},
    }
    for name, files in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        for rel, data in files.items():
            os.makedirs(os.path.dirname(folder / rel), exist_ok=True)
            (folder / rel).write_bytes(data)
        with pytest.raises(unickpt.CheckpointError, match="not a unickpt checkpoint") as ei:
            _save(str(folder))
        assert isinstance(ei.value, FileExistsError), type(ei.value)
        assert str(folder) in str(ei.value)
        assert _tree(folder) == files, name  # nothing deleted, nothing added


def test_item2_every_rank_refuses_a_foreign_folder(tmp_path):
    folder = tmp_path / "ck"
    os.makedirs(folder / "data")
    (folder / "data" / "mine.txt").write_bytes(b"precious")
    res = run_ranks(locked_save_worker, 2, str(folder))
    assert [r["type"] for r in res] == ["ForeignFolderError", "ForeignFolderError"], res
    assert "rank 0 reports" in res[1]["msg"] and "not a unickpt checkpoint" in res[1]["msg"]
    assert _tree(folder) == {"data/mine.txt": b"precious"}


def test_item2_user_files_inside_a_checkpoint_survive_every_save(tmp_path):
    """Files unickpt did not write are never deleted, even under ``data/``; unickpt's own old
    generations still are (only the committed save and the one it replaced remain)."""
    ckpt = tmp_path / "ck"
    first = _save(str(ckpt), 1)
    user = {
        "data/notes.txt": b"mine",
        "data/20200101T000000-aaaaaaaaaaaa/r00000-00.bin": b"looks like unickpt's but is mine",
        f"data/{first}/extra.txt": b"next to unickpt's files",
        "README.md": b"# my run",
    }
    for rel, data in user.items():
        os.makedirs((ckpt / rel).parent, exist_ok=True)
        (ckpt / rel).write_bytes(data)
    ids = [first] + [_save(str(ckpt), s) for s in (2, 3, 4)]
    tree = _tree(ckpt)
    for rel, data in user.items():
        assert tree.get(rel) == data, rel
    own = {n.split("/")[1] for n in tree if n.startswith("data/") and n.endswith(".bin") and "aaaa" not in n}
    assert own == set(ids[-2:]), (own, ids)  # the two older generations are gone
    check = _state(9)
    unickpt.load(str(ckpt), check, framework="torch")
    assert not mismatches(snapshot(check["model"], check["optimizer"]), snapshot(*tiny_model(seed=4)))


def test_item2_role_and_manager_sub_folders_still_save(tmp_path):
    """A folder that holds only unickpt checkpoints (role sub-folders, manager steps) is unickpt's."""
    root = tmp_path / "run"
    unickpt.save(str(root), _state(1), framework="torch", role="actor")
    _save(str(root), 2)  # role-less into a folder that holds only the actor's checkpoint
    _save(str(root), 3)
    unickpt.save(str(root), _state(4), framework="torch", role="critic")
    os.makedirs(tmp_path / "empty" / "sub")
    _save(str(tmp_path / "empty"), 5)  # empty sub-folders hold nothing to lose
    m = unickpt.CheckpointManager(str(tmp_path / "m"), keep_last=2, role="actor")
    plain = unickpt.CheckpointManager(str(tmp_path / "m"), keep_last=2)
    for step in (1, 2):
        m.save(step, _state(step), framework="torch")
        plain.save(step, _state(step + 10), framework="torch")
    assert [c.step for c in m.list_checkpoints()] == [1, 2]
    fresh = _state(0)
    assert plain.load_latest(fresh, framework="torch") == 2 and fresh["extra_state"] == {"seed": 12}


# ----------------------------------------------------------------------------- item 8


def _next_save_id(save_id: str) -> str:
    """The id the next save of the same (cached) plan gets: ``<base>-<seq:06d>`` (engine.plan_cache)."""
    m = re.fullmatch(r"(.*?)(?:-(\d{6}))?", save_id)
    assert m is not None
    return f"{m.group(1)}-{int(m.group(2) or 0) + 1:06d}"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_bytes(b"the user's precious file")
    return path


def test_item8_symlink_at_the_next_data_file_name(tmp_path, victim):
    ckpt = tmp_path / "ck"
    first = _save(str(ckpt), 1)
    nxt = _next_save_id(first)
    for part in (0, 1):
        name = ckpt / data_path(nxt, file_name(0, part))
        os.makedirs(name.parent, exist_ok=True)
        os.symlink(victim, name)
    try:
        _save(str(ckpt), 2)
    except unickpt.CheckpointError as e:
        assert "link" in str(e) or "exists" in str(e), e
    assert victim.read_bytes() == b"the user's precious file"
    check = _state(9)
    unickpt.load(str(ckpt), check, framework="torch")  # whatever happened, a whole checkpoint loads


def test_item8_symlinked_data_folder_is_refused_and_never_followed(tmp_path, victim):
    """``data/`` replaced by a link to a folder of the user's, holding files at the very names a
    save writes and its cleanup deletes: the save fails, nothing there is touched."""
    ckpt = tmp_path / "ck"
    ids = [_save(str(ckpt), s) for s in (1, 2)]
    outside = tmp_path / "outside"
    os.rename(ckpt / "data", outside)  # the real data now lives outside ...
    os.symlink(outside, ckpt / "data")  # ... reached through a link unickpt did not make
    before = _tree(outside)
    assert any(n.startswith(ids[0] + "/") for n in before)  # a name the next cleanup deletes
    with pytest.raises(unickpt.CheckpointError, match="link"):
        _save(str(ckpt), 3)
    assert _tree(outside) == before
    assert json.loads((ckpt / METADATA_FILE).read_bytes())["save_id"] == ids[1]


def test_item8_symlinks_where_cleanup_deletes_are_not_followed(tmp_path):
    """A link at a data file name and at a data folder name of an old generation: cleanup removes
    unickpt's names, never what they point at."""
    ckpt = tmp_path / "ck"
    ids = [_save(str(ckpt), s) for s in (1, 2)]
    outside = tmp_path / "outside"
    os.makedirs(outside / "dir")
    (outside / "file.bin").write_bytes(b"victim file")
    (outside / "dir" / "r00000-00.bin").write_bytes(b"victim in a folder")
    old = ckpt / "data" / ids[0]
    for f in os.listdir(old):
        os.unlink(old / f)
        os.symlink(outside / "file.bin", old / f)
    before = _tree(outside)
    _save(str(ckpt), 3)  # deletes generation ids[0]
    assert _tree(outside) == before
    os.symlink(outside / "dir", ckpt / "data" / "20200101T000000-bbbbbbbbbbbb")
    _save(str(ckpt), 4)  # deletes generation ids[1]
    assert _tree(outside) == before


# ----------------------------------------------------------------------------- item 9

_CHILD = textwrap.dedent("""
    import json, os, resource, sys, threading, tracemalloc
    tests = os.path.dirname(sys.argv[1])
    sys.path[:0] = [os.path.dirname(tests)]  # the repo root: tests.workers
    import torch
    torch.set_num_threads(1)
    import unickpt
    from tests.workers.rel_helpers import tiny_model

    def state():
        model, optim = tiny_model(seed=9)
        return {"model": model, "optimizer": optim, "extra_state": None}

    def run(op, path):
        if op == "load":
            unickpt.load(path, state(), framework="torch")
        elif op == "inspect":
            from unickpt.ops.inspect import load_metadata
            load_metadata(path)
        elif op == "latest":
            unickpt.CheckpointManager(path).load_latest(state(), framework="torch")
        elif op == "save":
            unickpt.save(path, state(), framework="torch")
        elif op == "verify":
            from unickpt.ops.inspect import load_metadata, verify
            storage, md, _ = load_metadata(path)
            report = verify(md, storage)
            if not report.ok:
                raise AssertionError(report.failures)
        else:
            raise ValueError(op)

    vm = int([l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize")][0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
    out = {}
    for name, (op, path) in json.loads(open(sys.argv[2]).read()).items():
        box = {}

        def target():
            tracemalloc.start()
            try:
                run(op, path)
                box["r"] = ["ok", ""]
            except unickpt.CheckpointError as e:
                box["r"] = [type(e).__name__, str(e)]
            except BaseException as e:
                box["r"] = ["NOT A CheckpointError: " + type(e).__name__, str(e)]
            box["peak"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()

        t = threading.Thread(target=target, daemon=True)
        t.start()
        t.join(float(sys.argv[3]))
        out[name] = box["r"] + [box["peak"]] if "r" in box else ["hung", "", 0]
        print(name, out[name][0], flush=True, file=sys.stderr)
    print(json.dumps(out), flush=True)
    os._exit(0)  # hung threads (if any) cannot be joined
""")


def _run_child(tmp_path, cases: dict[str, tuple[str, str]], deadline: float = 20.0) -> dict[str, list]:
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    here = os.path.dirname(__file__)
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, here, str(spec), str(deadline)],
        capture_output=True,
        text=True,
        timeout=deadline * len(cases) + 120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _sparse(path, size: int = 64 << 30) -> None:
    with open(path, "wb") as f:
        f.write(b'{"magic": "unickpt"')
    os.truncate(path, size)


def test_item9_fifos_devices_and_huge_files_fail_fast(tmp_path):
    """A FIFO, a link to /dev/zero or a 64 GiB sparse file as the metadata, the ``latest``
    pointer or the save lock: each is a clear CheckpointError, at once."""
    cases: dict[str, tuple[str, str]] = {}
    for kind in ("fifo", "zero", "sparse"):
        ckpt = tmp_path / f"meta-{kind}"
        _save(str(ckpt))
        meta = ckpt / METADATA_FILE
        os.unlink(meta)
        {"fifo": os.mkfifo, "zero": lambda p: os.symlink("/dev/zero", p), "sparse": _sparse}[kind](meta)
        cases[f"metadata {kind} (load)"] = ("load", str(ckpt))
        cases[f"metadata {kind} (inspect)"] = ("inspect", str(ckpt))

        root = tmp_path / f"latest-{kind}"
        unickpt.CheckpointManager(str(root)).save(1, _state(), framework="torch")
        os.unlink(root / "latest")
        {"fifo": os.mkfifo, "zero": lambda p: os.symlink("/dev/zero", p), "sparse": _sparse}[kind](root / "latest")
        cases[f"latest {kind}"] = ("latest", str(root))

        ckpt = tmp_path / f"lock-{kind}"
        os.makedirs(ckpt)
        lock = ckpt / "unickpt.save.lock.1"
        {"fifo": os.mkfifo, "zero": lambda p: os.symlink("/dev/zero", p), "sparse": _sparse}[kind](lock)
        cases[f"lock {kind}"] = ("save", str(ckpt))
    got = _run_child(tmp_path, cases)
    bad = {k: v for k, v in got.items() if v[0] in ("ok", "hung") or v[0].startswith("NOT")}
    assert not bad, bad
    for name, (_kind, msg, peak) in got.items():
        assert peak < 64 << 20, (name, peak)  # nothing big was read into memory
        if "sparse" in name:
            cap = 1 << 30 if name.startswith("metadata") else 64 << 10
            assert str(cap) in msg, (name, msg)  # the cap is named ...
        assert str(tmp_path) in msg, (name, msg)  # ... and the file


def test_item9_metadata_cap_is_an_option_and_memory_storage_applies_it(tmp_path):
    from unickpt.options import LoadLimits, LoadOptions
    from unickpt.storage.memory import MemoryStorage

    ckpt = str(tmp_path / "ck")
    _save(ckpt)
    size = os.path.getsize(os.path.join(ckpt, METADATA_FILE))
    with pytest.raises(unickpt.CheckpointError, match=f"{size - 1}.*max_metadata_bytes|max_metadata_bytes.*{size - 1}"):
        unickpt.load(
            ckpt, _state(9), framework="torch", options=LoadOptions(limits=LoadLimits(max_metadata_bytes=size - 1))
        )
    unickpt.load(ckpt, _state(9), framework="torch", options=LoadOptions(limits=LoadLimits(max_metadata_bytes=size)))
    mem = MemoryStorage(f"unickpt-item9-{tmp_path.name}")
    for name in data_files(ckpt):
        if name.startswith("data/") or name == METADATA_FILE:
            mem.write(name, [open(os.path.join(ckpt, name), "rb").read()])
    with pytest.raises(unickpt.CheckpointError, match=str(size - 1)):
        unickpt.load(
            mem.url, _state(9), framework="torch", options=LoadOptions(limits=LoadLimits(max_metadata_bytes=size - 1))
        )
    unickpt.load(mem.url, _state(9), framework="torch")
    mem.write("big-pointer", [b"x" * ((64 << 10) + 1)])
    with pytest.raises(unickpt.CheckpointError, match="65536"):
        mem.read("big-pointer", limit=64 << 10)


# ----------------------------------------------------------------------------- item 11


def _crc_of_zeros(n: int) -> int:
    chunk = bytes(1 << 20)
    crc = 0
    while n:
        k = min(n, len(chunk))
        crc = crc32c.crc32c(chunk[:k], crc)
        n -= k
    return crc


def test_item11_sizes_claimed_by_metadata_are_refused_before_allocation(tmp_path):
    """A 64 GiB sparse file backs a blob and a tensor shard that metadata claims: the blob is over
    the blob cap, the tensor's shape does not match the live model; both are refused before any
    allocation. ``inspect --verify`` streams a 2 GiB shard and a 2 GiB blob through a fixed
    buffer (the child's address space has 1 GiB to spare)."""
    cases = {}
    for case in ("blob", "tensor", "verify"):
        ckpt = tmp_path / case
        _save(str(ckpt))
        md = json.loads((ckpt / METADATA_FILE).read_bytes())
        sparse = md["files"][0].rsplit("/", 1)[0] + "/sparse.bin"
        size = (4 << 30) if case == "verify" else (64 << 30)
        with open(ckpt / sparse, "wb") as f:
            f.truncate(size)
        md["files"].append(sparse)
        fidx = len(md["files"]) - 1
        # the sparse file's size and chunk checksums (a chunk of zeros each) in the metadata
        chunk = md["checksums"]["chunk_size"]
        md["checksums"]["file_sizes"].append(size)
        crcs = base64.b64decode(md["checksums"]["crcs"])
        crcs += _crc_of_zeros(chunk).to_bytes(4, "little") * (size // chunk)
        md["checksums"]["crcs"] = base64.b64encode(crcs).decode()
        if case == "blob":
            md["blobs"]["extra_state/rank0"] = [fidx, 0, size]
        elif case == "tensor":
            shard = [0, 0, 1 << 31, 8, fidx, 0]
            md["tensors"]["model.0.weight"] = {"dtype": "float32", "shape": [1 << 31, 8], "shards": [shard]}
        else:
            md["tensors"]["big"] = {"dtype": "uint8", "shape": [size // 2], "shards": [[0, size // 2, fidx, 0]]}
            md["blobs"]["big-blob"] = [fidx, size // 2, size // 2]
        (ckpt / METADATA_FILE).write_text(json.dumps(md))
        cases[case] = ("verify" if case == "verify" else "load", str(ckpt))
    got = _run_child(tmp_path, cases, deadline=120.0)
    assert got["blob"][0] == "SizeLimitError" and "max_blob_bytes" in got["blob"][1], got["blob"]
    assert got["tensor"][0] == "ShapeMismatchError", got["tensor"]
    assert got["verify"][0] == "ok", got["verify"]
    for name, (_, _, peak) in got.items():
        assert peak < 64 << 20, (name, peak)
