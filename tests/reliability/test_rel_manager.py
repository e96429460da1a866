"""CheckpointManager: retention, the ``latest`` pointer (never ahead of a commit), discovery of
complete checkpoints only, roles, and failures of background saves."""

from __future__ import annotations

import errno
import json
import os
import re
import time
import warnings

import psutil
import pytest

import unickpt
from tests.workers.rel_faults import install_faulty_scheme
from tests.workers.rel_helpers import data_files, lock_record, mismatches, snapshot, step, tiny_model, write_lock
from unickpt.folder.lock import LOCK_FILE
from unickpt.format.records import METADATA_FILE


def _state(seed: int = 0) -> dict:
    model, optim = tiny_model(seed=seed)
    return {"model": model, "optimizer": optim, "extra_state": {"seed": seed}}


def _steps(manager) -> list[int]:
    return [c.step for c in manager.list_checkpoints()]


def test_retention_keeps_the_newest_and_latest(tmp_path):
    m = unickpt.CheckpointManager(str(tmp_path), keep_last=2)
    st = _state()
    for s in (10, 20, 30, 40, 50):
        step(st["model"], st["optimizer"], s)
        m.save(s, st, framework="torch")
    assert _steps(m) == [40, 50] and m.latest_step() == 50
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000040", "step_00000050"]
    assert json.loads(open(tmp_path / "latest").read()) == {"step": 50, "path": "step_00000050"}
    fresh = _state(seed=9)
    assert m.load_latest(fresh, framework="torch") == 50
    assert not mismatches(snapshot(fresh["model"], fresh["optimizer"]), snapshot(st["model"], st["optimizer"]))
    assert fresh["extra_state"] == {"seed": 0}
    # rolling back: saving an older step moves latest there and never deletes it
    m.save(5, st, framework="torch")
    assert m.latest_step() == 5 and _steps(m) == [5, 40, 50]


def test_latest_moves_only_after_the_commit(tmp_path):
    m = unickpt.CheckpointManager(str(tmp_path), keep_last=3)
    st = _state()
    m.save(1, st, framework="torch")
    seen = []

    def spy(ev):
        if ev.phase in ("save.write.file", "save.commit.begin", "save.commit"):
            seen.append((ev.phase, m.read_pointer().step))

    unickpt.default_checkpointer().events.add_listener(spy)
    try:
        h = m.save(2, st, framework="torch", async_save=True)
        h.wait()
    finally:
        unickpt.default_checkpointer().events.remove_listener(spy)
    assert seen and {p for p, _ in seen} == {"save.write.file", "save.commit.begin", "save.commit"}
    assert all(pointer == 1 for _, pointer in seen), seen  # even right after the commit
    assert m.read_pointer().step == 2 and h.done()


def test_failed_background_save_never_moves_latest(tmp_path):
    install_faulty_scheme("write", fail_times=0)
    m = unickpt.CheckpointManager(f"faulty://{tmp_path}", keep_last=3)
    st = _state()
    m.save(1, st, framework="torch")
    install_faulty_scheme("write", fail_times=10**6, errno_code=errno.EACCES, match="/data/")
    h = m.save(2, st, framework="torch", async_save=True)
    with pytest.raises(unickpt.StorageError, match="step_00000002/data/"):
        h.wait()
    assert m.read_pointer().step == 1 and _steps(m) == [1]
    h3 = m.save(3, st, framework="torch", async_save=True)  # fails too; nobody waits on it
    deadline = time.monotonic() + 30
    while not h3.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    install_faulty_scheme("write", fail_times=0)
    with pytest.raises(unickpt.CheckpointError, match="previous asynchronous save .* failed"):
        m.save(4, st, framework="torch")
    m.save(4, st, framework="torch")  # reported once; the next save goes through
    assert _steps(m) == [1, 4] and m.latest_step() == 4
    for s in (2, 3):  # the failed saves left no file behind (at most an empty folder)
        assert not data_files(str(tmp_path / f"step_{s:08d}"))


def test_discovery_ignores_incomplete_and_corrupt(tmp_path):
    m = unickpt.CheckpointManager(str(tmp_path), keep_last=10)
    st = _state()
    for s in (1, 2, 3):
        m.save(s, st, framework="torch")
    open(tmp_path / "step_00000002" / METADATA_FILE, "w").write("{not json")
    os.unlink(tmp_path / "step_00000003" / METADATA_FILE)  # looks like an interrupted save
    os.makedirs(tmp_path / "step_00000009" / "data")
    open(tmp_path / "step_00000009" / "data" / "x.bin", "wb").write(b"x")
    os.makedirs(tmp_path / "unrelated")
    open(tmp_path / "unrelated" / "notes.txt", "w").write("hi")
    assert _steps(m) == [1]
    with pytest.warns(UserWarning, match="names an incomplete checkpoint; using the newest complete one"):
        assert m.latest_step() == 1  # latest named step 3, which is no longer complete
    open(tmp_path / "latest", "w").write("garbage")
    with pytest.warns(UserWarning, match="malformed"):
        assert m.latest_step() == 1


def test_retention_removes_old_leftovers_but_not_live_saves(tmp_path):
    m = unickpt.CheckpointManager(str(tmp_path), keep_last=3)
    st = _state()
    m.save(1, st, framework="torch")
    parent = psutil.Process(os.getppid())  # a live process of another "job"
    live = lock_record(save_id="live-save", pid=parent.pid, pid_start=parent.create_time())
    for s, owner in ((2, live), (3, None)):
        d = tmp_path / f"step_{s:08d}"
        os.makedirs(d / "data" / "x")
        open(d / "data" / "x" / "r00000-00.bin", "wb").write(b"partial")
        open(d / "unickpt.data.x", "w").write("{}")  # the marker every save writes before its data
        if owner is not None:  # another save in progress there
            write_lock(str(d), owner)
    m.save(4, st, framework="torch")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000001", "step_00000002", "step_00000004"]
    os.unlink(tmp_path / "step_00000002" / f"{LOCK_FILE}.1")  # that save died: its leftovers go next time
    m.save(5, st, framework="torch")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000001", "step_00000004", "step_00000005"]


def test_roles_share_a_root_without_touching_each_other(tmp_path):
    actor = unickpt.CheckpointManager(str(tmp_path), keep_last=1, role="actor")
    critic = unickpt.CheckpointManager(str(tmp_path), keep_last=2, role="critic")
    a, c = _state(1), _state(2)
    for s in (1, 2, 3):
        actor.save(s, a, framework="torch")
        critic.save(s, c, framework="torch")
    assert _steps(actor) == [3] and _steps(critic) == [2, 3]
    assert actor.read_pointer().step == 3 and critic.read_pointer().step == 3
    assert sorted(os.listdir(tmp_path / "step_00000002")) == ["critic"]
    fresh = _state(7)
    assert critic.load_latest(fresh, framework="torch") == 3
    assert fresh["extra_state"] == {"seed": 2}


def test_empty_root_and_memory_backend():
    m = unickpt.CheckpointManager("memory://unickpt-manager-test", keep_last=1)
    fresh = _state(3)
    before = snapshot(fresh["model"], fresh["optimizer"])
    assert m.latest_step() is None and m.load_latest(fresh, framework="torch") is None
    assert not mismatches(snapshot(fresh["model"], fresh["optimizer"]), before)  # untouched
    st = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.save(1, st, framework="torch")
        m.save(2, st, framework="torch", async_save=True).wait()
    assert _steps(m) == [2] and m.load_latest(fresh, framework="torch") == 2
    with pytest.raises(ValueError):
        unickpt.CheckpointManager("x", keep_last=0)
    with pytest.raises(ValueError):
        m.path_for(-1)


def test_issue9_item3_roleless_manager_never_touches_role_checkpoints(tmp_path):
    """A role-less manager and a ``role=`` manager share a root and save interleaved steps with a
    small ``keep_last``: each one's retention deletes only its own checkpoints, never the other's
    (in particular never the step the role's ``latest`` names)."""
    plain = unickpt.CheckpointManager(str(tmp_path), keep_last=1)
    actor = unickpt.CheckpointManager(str(tmp_path), keep_last=2, role="actor")
    p, a = _state(1), _state(2)
    for s in (1, 2, 3, 4):
        step(a["model"], a["optimizer"], s)
        actor.save(s, a, framework="torch")
        if s == 4:
            want = snapshot(a["model"], a["optimizer"])
        plain.save(s + 1, p, framework="torch")  # steps 2..5: they share folders with the actor's
    assert _steps(actor) == [3, 4] and actor.read_pointer().step == 4
    assert _steps(plain) == [5] and plain.read_pointer().step == 5
    assert sorted(os.listdir(tmp_path / "step_00000004")) == ["actor"]  # the role-less step 4 went
    fresh = _state(9)
    assert actor.load_latest(fresh, framework="torch") == 4
    assert not mismatches(snapshot(fresh["model"], fresh["optimizer"]), want)
    assert fresh["extra_state"] == {"seed": 2}


def test_issue10_item4_manager_reports_every_failed_async_save(tmp_path):
    install_faulty_scheme("write", fail_times=0)
    m = unickpt.CheckpointManager(f"faulty://{tmp_path}", keep_last=3)
    st = _state()
    install_faulty_scheme("write", fail_times=10**6, errno_code=errno.EACCES, match="/data/")
    handles = [m.save(s, st, framework="torch", async_save=True) for s in (1, 2)]  # both fail, unseen
    deadline = time.monotonic() + 60
    while not all(h.done() for h in handles) and time.monotonic() < deadline:
        time.sleep(0.01)
    install_faulty_scheme("write", fail_times=0)
    with pytest.raises(unickpt.AsyncSaveFailures) as info:
        m.save(3, st, framework="torch")
    err = info.value
    assert [path for path, _ in err.failures] == [m.path_for(1), m.path_for(2)]
    assert all(isinstance(cause, unickpt.StorageError) and cause.errno == errno.EACCES for _, cause in err.failures)
    assert err.__cause__ is err.failures[0][1]
    msg = str(err)
    assert m.path_for(1) in msg and m.path_for(2) in msg and msg.count("injected EACCES") == 2, msg
    m.save(3, st, framework="torch")  # reported once: the next save goes through
    assert _steps(m) == [3]


def _bump_format_version(folder, version: int = 99) -> None:
    """Make ``folder``'s metadata look written by a newer unickpt (a format version this one
    does not read)."""
    path = os.path.join(folder, METADATA_FILE)
    doc = json.loads(open(path).read())
    doc["format_version"] = version
    open(path, "w").write(json.dumps(doc))


def _files(root) -> list[str]:
    return data_files(str(root))


def _saves_warning(m, st, steps) -> list[str]:
    """Save ``steps`` with ``m``; the texts of the warnings they gave."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for s in steps:
            m.save(s, st, framework="torch")
    return [str(w.message) for w in got]


def test_issue26_item1_undecodable_checkpoint_inside_keep_last_is_kept(tmp_path):
    """A checkpoint whose metadata this version cannot decode (a newer format version, or bytes
    it cannot parse) is not an incomplete leftover: retention keeps it and says so."""
    m = unickpt.CheckpointManager(str(tmp_path), keep_last=3)
    st = _state()
    for s in (1, 2):
        m.save(s, st, framework="torch")
    _bump_format_version(tmp_path / "step_00000001")
    open(tmp_path / "step_00000002" / METADATA_FILE, "w").write("{written by something else")
    before = _files(tmp_path)
    said = _saves_warning(m, st, [3])
    after = _files(tmp_path)
    assert [f for f in before if f.startswith(("step_00000001/", "step_00000002/"))] == [
        f for f in after if f.startswith(("step_00000001/", "step_00000002/"))
    ]
    assert any(re.search(r"step_00000001 \(unreadable: .*format version 99", w) for w in said), said
    assert any("step_00000002 (unreadable" in w for w in said), said
    assert _steps(m) == [3]
    states = {s.step: s.status for s in m.step_states()}
    assert states == {1: "unreadable", 2: "unreadable", 3: "complete"}


def test_issue26_item1_folder_named_like_a_step_keeps_the_users_files(tmp_path):
    """``step_00000000/notes.txt`` and ``step_00000000/data/x.bin`` are the user's: no save,
    and no retention, ever deletes them (nothing there is unickpt's)."""
    user = tmp_path / "step_00000000"
    os.makedirs(user / "data")
    open(user / "notes.txt", "w").write("mine")
    open(user / "data" / "x.bin", "wb").write(b"mine too")
    m = unickpt.CheckpointManager(str(tmp_path), keep_last=1)
    st = _state()
    said = _saves_warning(m, st, [1, 2, 3])
    assert sorted(os.listdir(user)) == ["data", "notes.txt"] and os.listdir(user / "data") == ["x.bin"]
    assert any("step_00000000 (foreign" in w for w in said), said
    assert open(user / "notes.txt").read() == "mine" and _steps(m) == [3]
    assert {s.step: s.status for s in m.step_states()} == {0: "foreign", 3: "complete"}


def test_issue26_item1_copied_metadata_without_data_is_not_a_checkpoint(tmp_path):
    """A step folder holding only a copy of a metadata file (no data) is not complete: it
    neither counts among the ``keep_last`` newest nor pushes a real checkpoint out, ``latest``
    never falls back to it, and retention keeps it (it cannot prove it wrote it)."""
    m = unickpt.CheckpointManager(str(tmp_path), keep_last=2)
    st = _state()
    for s in (1, 2):
        step(st["model"], st["optimizer"], s)
        m.save(s, st, framework="torch")
    want = snapshot(st["model"], st["optimizer"])
    os.makedirs(tmp_path / "step_00000099")
    open(tmp_path / "step_00000099" / METADATA_FILE, "wb").write(
        open(tmp_path / "step_00000002" / METADATA_FILE, "rb").read()
    )
    said = _saves_warning(m, st, [3])
    assert _steps(m) == [2, 3]  # 2 is still one of the two newest complete checkpoints
    assert os.listdir(tmp_path / "step_00000099") == [METADATA_FILE]
    assert any(re.search(r"step_00000099 \(damaged: data file .* is missing", w) for w in said), said
    os.unlink(tmp_path / "latest")
    os.unlink(tmp_path / "step_00000003" / METADATA_FILE)  # 3 is gone: the newest complete one is 2
    assert m.latest_step() == 2
    fresh = _state(seed=5)
    assert m.load_latest(fresh, framework="torch") == 2
    assert not mismatches(snapshot(fresh["model"], fresh["optimizer"]), want)
