"""Property test of ``CheckpointManager`` retention over random folder states (issue 26, item 1).

Each example builds a manager root by copying one template checkpoint (saved once) into step
folders of random kinds, labelling every file it creates as unickpt's (a file a save writes) or
not, then runs retention. The expected survivors come from the rule of the issue, applied here
to the labels, not by the manager: of the *complete* folders, all but the ``keep_last`` newest
and the one ``latest`` names lose their unickpt files; *abandoned* folders (a save's marker and
data, no metadata, no live lock, older than ``latest``) lose their unickpt files; every other
file stays (user files anywhere, folders with newer-format / corrupt / copied metadata, damaged
data, unmarked data, live saves, the checkpoints of another role).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unickpt
from tests.support.hypothesis_profiles import examples
from tests.workers.rel_helpers import lock_record
from unickpt.folder.lock import LOCK_FILE, lock_is_live
from unickpt.format.records import METADATA_FILE
from unickpt.storage import open_storage

KINDS = (
    "complete",  # a checkpoint as a save leaves it
    "abandoned",  # an interrupted save: marker + part of its data (+ a stale lock), no metadata
    "live",  # a save in progress: marker + data + a live lock, no metadata
    "newer",  # complete, metadata of a newer format version
    "corrupt",  # complete, metadata bytes that do not parse
    "metadata_only",  # a copied metadata file, no data
    "damaged",  # complete but a data file is one byte short
    "unmarked",  # data files of unickpt's form without a marker (e.g. copied by hand)
    "foreign",  # only the user's files
)
NEVER_TOUCHED = {"live", "newer", "corrupt", "metadata_only", "damaged", "unmarked", "foreign"}
NAMED_IN_WARNING = {"newer", "corrupt", "metadata_only", "damaged", "unmarked", "foreign"}


@dataclass
class Template:
    """The files of one saved checkpoint (relative name -> bytes) and its save id."""

    files: dict[str, bytes]
    save_id: str
    data_file: str  # its first data file


@dataclass
class Root:
    path: str
    ours: dict[int, set[str]] = field(default_factory=dict)  # step -> unickpt's files of the manager's role


@pytest.fixture(scope="module")
def template() -> Template:
    with tempfile.TemporaryDirectory() as d:
        model = torch.nn.Linear(3, 2)
        unickpt.save(os.path.join(d, "ckpt"), {"model": model}, framework="torch")
        files = {}
        for dirpath, _, names in os.walk(os.path.join(d, "ckpt")):
            for n in names:
                full = os.path.join(dirpath, n)
                files[os.path.relpath(full, os.path.join(d, "ckpt"))] = open(full, "rb").read()
    save_id = json.loads(files[METADATA_FILE])["save_id"]
    data = [n for n in files if n.startswith("data/")]
    assert sorted(files) == sorted([METADATA_FILE, f"unickpt.data.{save_id}", *data]) and data
    recorded = json.loads(files[METADATA_FILE])["files"]  # the data files (not the save's phase records)
    return Template(files, save_id, sorted(recorded)[0])


def _lock(live: bool) -> bytes:
    if live:  # a live process of another "job" that took the lock now
        parent = psutil.Process(os.getppid())
        return lock_record(save_id="live-save", pid=parent.pid, pid_start=parent.create_time()).encode()
    old = time.time() - 10 * 86400  # its heartbeat stopped ten days ago: lease long expired
    return lock_record(save_id="dead-save", host="gone-host", pid=1, created_unix=old, renewed_unix=old).encode()


def _write(root: str, name: str, data: bytes) -> None:
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _build(path: str, t: Template, folders: list[tuple[str, bool, bool]], role: str | None) -> Root:
    """Step ``i`` of ``folders`` (kind, with user files, with another role's checkpoint) at
    ``path``; returns the root with the manager's own files of each step labelled."""
    root = Root(path)
    base_of = (lambda s: f"step_{s:08d}/") if role is None else (lambda s: f"step_{s:08d}/{role}/")
    other_of = (lambda s: f"step_{s:08d}/critic/") if role is None else (lambda s: f"step_{s:08d}/")
    meta, marker, data = METADATA_FILE, f"unickpt.data.{t.save_id}", t.data_file
    for s, (kind, user_files, other) in enumerate(folders):
        base = base_of(s)
        ours: dict[str, bytes] = {}
        theirs: dict[str, bytes] = {}
        if kind in ("complete", "newer", "corrupt", "damaged"):
            ours = dict(t.files)
            if kind == "newer":
                doc = json.loads(ours[meta])
                doc["format_version"] = 99
                ours[meta] = json.dumps(doc).encode()
            elif kind == "corrupt":
                ours[meta] = b'{"magic": "unickpt", "format_version": 3, '
            elif kind == "damaged":
                ours[data] = ours[data][:-1]
        elif kind in ("abandoned", "live"):
            ours = {marker: t.files[marker], data: t.files[data][:5], LOCK_FILE + ".1": _lock(kind == "live")}
        elif kind == "metadata_only":
            ours = {meta: t.files[meta]}
        elif kind == "unmarked":
            theirs = {data: t.files[data]}
        if kind == "foreign" or user_files:
            theirs.update({"notes.txt": b"mine", "data/x.bin": b"mine", f"data/{t.save_id}/README": b"mine"})
        for n, b in {**ours, **theirs}.items():
            _write(path, base + n, b)
        root.ours[s] = {base + n for n in ours}
        if other:
            for n, b in t.files.items():
                _write(path, other_of(s) + n, b)
    return root


def _files(path: str) -> set[str]:
    out = set()
    for dirpath, _, names in os.walk(path):
        for n in names:
            out.add(os.path.relpath(os.path.join(dirpath, n), path))
    return out


def _expected_deleted(kinds: list[str], keep_last: int | None, latest: int | None) -> set[int]:
    """The rule of issue 26 item 1, stated plainly."""
    complete = [s for s, k in enumerate(kinds) if k == "complete"]
    keep = set(complete if keep_last is None else complete[-keep_last:]) | {latest}
    gone = {s for s in complete if s not in keep}
    if latest is not None:
        gone |= {s for s, k in enumerate(kinds) if k == "abandoned" and s < latest}
    return gone


def test_lock_fixtures_are_what_they_claim(tmp_path):
    _write(str(tmp_path), "a/" + LOCK_FILE + ".1", _lock(True))
    _write(str(tmp_path), "b/" + LOCK_FILE + ".1", _lock(False))
    storage = open_storage(str(tmp_path))
    assert lock_is_live(storage, "a/") and not lock_is_live(storage, "b/")


folder = st.tuples(st.sampled_from(KINDS), st.booleans(), st.booleans())


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    folders=st.lists(folder, min_size=1, max_size=7),
    keep_last=st.one_of(st.none(), st.integers(1, 4)),
    latest_choice=st.one_of(st.none(), st.integers(0, 7)),
    role=st.sampled_from([None, "actor"]),
)
def test_retention_deletes_exactly_what_the_rule_allows(template, folders, keep_last, latest_choice, role):
    with tempfile.TemporaryDirectory() as path:
        root = _build(path, template, folders, role)
        latest = latest_choice
        if latest is not None:
            pointer = "latest" if role is None else f"latest.{role}"
            _write(path, pointer, json.dumps({"step": latest, "path": f"step_{latest:08d}"}).encode())
        before = _files(path)
        kinds = [k for k, _, _ in folders]
        gone = _expected_deleted(kinds, keep_last, latest)
        expected = before - {n for s in gone for n in root.ours[s]}

        m = unickpt.CheckpointManager(path, keep_last=keep_last, role=role)
        plan = m.plan_retention()  # what `unickpt prune --dry-run` lists; deletes nothing
        assert _files(path) == before
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            deleted = m.apply_retention()
        assert _files(path) == expected, (kinds, keep_last, latest, role)
        assert {n for _, groups in plan.deletions for g in groups for n in g} == before - expected
        assert deleted == sorted(gone)
        said = " ".join(str(w.message) for w in caught)
        for s, k in enumerate(kinds):
            if k in NAMED_IN_WARNING:
                assert f"step_{s:08d} (" in said, (s, k, said)
            if k in NEVER_TOUCHED or s not in gone:
                assert root.ours[s] <= _files(path)
        survivors = [s for s, k in enumerate(kinds) if k == "complete" and s not in gone]
        assert [c.step for c in m.list_checkpoints()] == survivors
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert m.apply_retention() == [] and _files(path) == expected  # a second pass changes nothing
