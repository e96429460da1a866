"""Commit as its own abstraction (``folder.publish``): a temporary name + atomic rename for file
systems, one atomic (conditional) put for object stores; leftovers are the publisher's to name.

- cleanup after a save / retention deletes only temporaries the publisher itself makes, never a
  user's file that merely looks like one;
- a backend without rename (an object store) commits a whole save, a manager pointer and a save
  lock through single puts: no temporary name ever exists, no rename is ever called;
- a save makes its durability calls in the documented order (recorded on a backend that needs
  them): data written -> data folders synced -> metadata published (temporary written, renamed,
  the folder synced) -> cleanup.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from tests.support.compare import same_state
from unickpt.format.records import METADATA_FILE


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 6)).square().mean().backward()
    optim.step()
    return {"model": model, "optimizer": optim, "extra_state": {"step": seed}}


def test_a2_cleanup_deletes_only_the_publishers_own_leftovers(tmp_path):
    """A leftover temporary of an interrupted metadata commit (the name unickpt's own commit
    gives it) is removed by the next save; a user's file that only starts like one stays. The
    same for the manager's ``latest`` pointer."""
    ckpt = tmp_path / "ck"
    unickpt.save(str(ckpt), _state(1), framework="torch")
    leftover = f"{METADATA_FILE}.tmp-{uuid.uuid4().hex}"  # what an interrupted commit leaves
    users = [f"{METADATA_FILE}.tmp-my-notes", f"{METADATA_FILE}.tmp-"]
    for name in [leftover, *users]:
        (ckpt / name).write_bytes(b"{}")
    unickpt.save(str(ckpt), _state(2), framework="torch")
    left = sorted(os.listdir(ckpt))
    assert leftover not in left, left
    assert all(u in left for u in users), left
    fresh = _state(9)
    unickpt.load(str(ckpt), fresh, framework="torch")
    assert same_state(fresh["model"].state_dict(), _state(2)["model"].state_dict())

    manager = unickpt.CheckpointManager(str(tmp_path / "run"), keep_last=1)
    manager.save(1, _state(1), framework="torch")
    root = tmp_path / "run"
    mine, theirs = f"latest.tmp-{uuid.uuid4().hex}", "latest.tmp-backup"
    (root / mine).write_bytes(b"{}")
    (root / theirs).write_bytes(b"keep me")
    manager.save(2, _state(2), framework="torch")
    left = sorted(os.listdir(root))
    assert mine not in left and theirs in left, left
    assert (root / theirs).read_bytes() == b"keep me"


# ----------------------------------------------------------------------------- recording backends


class Recording:
    """A memory backend that records every call (op, name) in order; ``caps`` replaces its
    capability record (to look like a file system that needs syncs, or an object store)."""

    def __init__(self, inner: Any, caps: Any, log: list[tuple[str, str]]) -> None:
        self.inner, self.capabilities, self.log = inner, caps, log
        self.url = inner.url
        self._lock = threading.Lock()

    def _rec(self, op: str, name: str) -> None:
        with self._lock:
            self.log.append((op, name))

    def write(self, name: str, parts: Sequence[Any]) -> None:
        self._rec("write", name)
        self.inner.write(name, parts)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._rec("read_into", name)
        self.inner.read_into(name, offset, out)

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        self._rec("read_into_cached", name)
        self.inner.read_into_cached(name, offset, out)

    def read(self, name: str, limit: int = 1 << 30) -> bytes | None:
        self._rec("read", name)
        return self.inner.read(name, limit)

    def size(self, name: str) -> int | None:
        self._rec("size", name)
        return self.inner.size(name)

    def list(self, prefix: str = "") -> list[str]:
        self._rec("list", prefix)
        return self.inner.list(prefix)

    def delete(self, names: Sequence[str]) -> None:
        for n in names:
            self._rec("delete", n)
        self.inner.delete(names)

    def put(self, name: str, data: bytes) -> None:
        self._rec("put", name)
        self.inner.put(name, data)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        self._rec("create_exclusive", name)
        return self.inner.create_exclusive(name, data)

    def update_exclusive(self, name: str, expected: bytes, data: bytes) -> bool:
        self._rec("update_exclusive", name)
        return self.inner.update_exclusive(name, expected, data)

    def rename(self, src: str, dst: str) -> None:
        self._rec("rename", f"{src} -> {dst}")
        if not self.capabilities.atomic_rename:
            raise AssertionError(f"rename({src}, {dst}) called on a backend that declares no rename")
        self.inner.rename(src, dst)

    def sync(self, folder: str = "") -> None:
        self._rec("sync", folder)
        self.inner.sync(folder)


@pytest.fixture
def recording(tmp_path):
    """Register ``recfs://`` (needs syncs, atomic rename, no atomic put: a file system) and
    ``recs3://`` (atomic conditional put, no rename, no sync: an object store), both over memory."""
    from unickpt.storage import register_storage
    from unickpt.storage.base import StorageCapabilities
    from unickpt.storage.memory import MemoryStorage

    fs = StorageCapabilities(
        atomic_put=False,
        atomic_rename=True,
        rename_replaces=True,
        conditional_create=True,
        needs_sync=True,
        shared_page_cache=False,
    )
    s3 = StorageCapabilities(
        atomic_put=True,
        atomic_rename=False,
        rename_replaces=False,
        conditional_create=True,
        needs_sync=False,
        shared_page_cache=False,
    )
    logs: dict[str, list[tuple[str, str]]] = {"recfs": [], "recs3": []}
    for scheme, caps in (("recfs", fs), ("recs3", s3)):

        def factory(path: str, options: Any, caps: Any = caps, log: list = logs[scheme]) -> Any:
            return Recording(MemoryStorage(f"{tmp_path.name}/{path}", options), caps, log)

        register_storage(scheme, factory, replace=True)
    return logs


def test_a2_object_store_commits_with_single_puts_and_no_temporaries(recording):
    """Over a backend with no rename (atomic conditional put only): a save over an older
    checkpoint, a load, a manager's pointer and retention, and the save lock all work; the
    metadata and the pointer are each one ``put``, the lock and markers ``create_exclusive``;
    no temporary name is ever written and ``rename`` is never called."""
    log = recording["recs3"]
    unickpt.save("recs3://ck", _state(1), framework="torch")
    unickpt.save("recs3://ck", _state(2), framework="torch")
    fresh = _state(9)
    unickpt.load("recs3://ck", fresh, framework="torch")
    assert same_state(fresh["model"].state_dict(), _state(2)["model"].state_dict())
    manager = unickpt.CheckpointManager("recs3://run", keep_last=1)
    for step in (1, 2):
        manager.save(step, _state(step), framework="torch")
    assert manager.load_latest(_state(7), framework="torch") == 2
    assert [c.step for c in manager.list_checkpoints()] == [2]

    ops = {op for op, _ in log}
    assert "rename" not in ops and "sync" not in ops, ops
    # each save opens its own folder (names are relative to it): two saves, then two manager steps
    assert [n for op, n in log if op == "put"] == [METADATA_FILE] * 3 + ["latest", METADATA_FILE, "latest"]
    created = [n for op, n in log if op in ("write", "create_exclusive")]
    assert not [n for n in created if ".tmp-" in n or ".old-" in n], created
    assert any(n.startswith("unickpt.save.lock") for op, n in log if op == "create_exclusive")


def test_a5_save_makes_durability_calls_in_the_documented_order(recording):
    """On a backend that needs syncs: every data file is written, then every data folder it is
    in is synced (rank 0, before the size checks), then the metadata is published: a temporary
    written, renamed over the metadata, the folder synced; only then is stale data deleted."""
    log = recording["recfs"]
    for seed in (1, 2):  # the third save deletes the first one's data after its commit
        unickpt.save("recfs://ck", _state(seed), framework="torch")
    first = len(log)
    unickpt.save("recfs://ck", _state(3), framework="torch")
    ops = log[first:]

    def at(pred: Any) -> list[int]:
        return [i for i, (op, n) in enumerate(ops) if pred(op, n)]

    data_writes = at(lambda op, n: op == "write" and n.startswith("data/") and not n.endswith("/phases.json"))
    records = at(lambda op, n: op == "write" and n.startswith("data/") and n.endswith("/phases.json"))
    folders = {ops[i][1].rsplit("/", 1)[0] for i in data_writes}
    syncs = {f: at(lambda op, n, f=f: op == "sync" and n == f) for f in [*folders, "data"]}
    renames = at(lambda op, n: op == "rename" and n.endswith(f" -> {METADATA_FILE}"))
    assert data_writes and len(renames) == 1, ops
    (rename,) = renames
    tmp = ops[rename][1].split(" -> ")[0]
    tmp_write = at(lambda op, n: op == "write" and n == tmp)
    root_sync = at(lambda op, n: op == "sync" and n == "")
    sizes = at(lambda op, n: op == "size" and n.startswith("data/"))
    deletes = at(lambda op, n: op == "delete" and n.startswith("data/"))
    assert all(s for s in syncs.values()), syncs
    last_data_write = max(data_writes)
    for f, idx in syncs.items():
        assert last_data_write < min(idx) < rename, (f, ops)
    assert max(i for idx in syncs.values() for i in idx) < min(sizes) < rename, ops
    assert len(tmp_write) == 1 and last_data_write < tmp_write[0] < rename, ops
    assert root_sync and min(i for i in root_sync if i > rename) == rename + 1, ops
    assert deletes and min(deletes) > rename + 1, ops  # the first save's data, after the commit
    assert len(records) == 1 and records[0] > rename, ops  # the save's phase records: written after its commit
    assert METADATA_FILE in tmp and tmp != METADATA_FILE
    assert not [n for op, n in ops if op == "put"], ops  # never a non-atomic overwrite


def test_a2_publication_without_a_replacing_rename_survives_a_crash_mid_swap(tmp_path):
    """Where rename refuses an existing target (HDFS's plain rename) the publisher moves the old
    version aside first. Killed right after that (the new version not yet in place, the old one
    not put back), readers through the publisher still get the old version; the next
    publication takes the free name and the cleanup removes what the crash left. Whole saves,
    loads and a manager run over such a backend."""
    from tests.fixtures.contract import Flaky, NoReplaceRename
    from unickpt.folder.publish import RenamePublisher, publisher_for
    from unickpt.storage import register_storage
    from unickpt.storage.memory import MemoryStore

    store = MemoryStore()
    s = NoReplaceRename("swap", store=store)
    pub = publisher_for(s)
    assert isinstance(pub, RenamePublisher)
    pub.publish("m", b"v1")
    pub.publish("m", b"v2")
    assert pub.read("m") == b"v2" and s.list() == ["m"]
    # rename 1 (tmp -> m) is refused (m exists), rename 2 (m -> old) lands, then the process
    # "dies": rename 3 (tmp -> m) and the restoring rename 4 fail, and so does every delete
    crashing = Flaky(s).fail("rename", "ok", "ok", "permanent", "permanent").fail("delete", "permanent")
    with pytest.raises(OSError):
        RenamePublisher(crashing).publish("m", b"v3")
    assert s.read("m") is None and len(s.list("m.")) == 2  # the old version aside + the new temporary
    assert pub.read("m") == b"v2"  # still the committed version, never nothing
    left = pub.leftovers("m")
    assert sorted(left) == s.list("m.") and all(pub.is_leftover(n, "m") for n in left)
    pub.publish("m", b"v4")
    assert pub.read("m") == b"v4"
    s.delete(pub.leftovers("m"))
    assert s.list() == ["m"]

    register_storage("norename", lambda path, options: NoReplaceRename(f"{tmp_path.name}/{path}", store=store))
    for seed in (1, 2, 3):
        unickpt.save("norename://ck", _state(seed), framework="torch")
    fresh = _state(9)
    unickpt.load("norename://ck", fresh, framework="torch")
    assert same_state(fresh["model"].state_dict(), _state(3)["model"].state_dict())
    manager = unickpt.CheckpointManager("norename://run", keep_last=1)
    for step in (1, 2):
        manager.save(step, _state(step), framework="torch")
    assert manager.load_latest(_state(7), framework="torch") == 2
    names = store.objects
    assert not [k for k in names if ".tmp-" in k or ".old-" in k], sorted(names)
