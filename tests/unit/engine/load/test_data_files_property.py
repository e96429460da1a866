"""One rule for "are a checkpoint's data files all there" (issue 39, item 26).

A template checkpoint (one model, two data files, a blob) is saved once; each example copies it
into step folders of a ``CheckpointManager`` root and puts each data file into one of the states
below. The expected verdict comes from the rule written down here, applied to the states, not
by the code under test: a step is complete when every data file is a regular file holding at
least its recorded size (``exact`` or ``long``; the bytes past the recorded end are never read).
Then ``latest_step``, ``list_checkpoints``, ``unickpt ls``'s states, ``verify`` and a load must all
give that verdict, and a load that succeeds returns the saved values.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unickpt
from tests.support.hypothesis_profiles import examples
from unickpt.errors import CheckpointError
from unickpt.format.records import METADATA_FILE
from unickpt.ops.inspect import load_metadata
from unickpt.ops.verify import verify

STATES = ("exact", "long", "missing", "short", "empty", "link", "folder")
COMPLETE_STATES = {"exact", "long"}  # the rule: at least the recorded bytes, in a regular file


@pytest.fixture(scope="module")
def template() -> tuple[dict[str, bytes], list[str], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        unickpt.save(ckpt, {"model": model, "extra": {"note": "x"}}, framework="torch")
        files = {}
        for dirpath, _, names in os.walk(ckpt):
            for n in names:
                full = os.path.join(dirpath, n)
                files[os.path.relpath(full, ckpt)] = open(full, "rb").read()
    data = json.loads(files[METADATA_FILE])["files"]
    assert len(data) >= 2, data  # two files per rank by default: the states mix within a step
    return files, sorted(data), saved


def _build(step_dir: str, files: dict[str, bytes], data: list[str], states: list[str]) -> None:
    for name, blob in files.items():
        path = os.path.join(step_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if name not in data:
            with open(path, "wb") as f:
                f.write(blob)
            continue
        state = states[data.index(name)]
        if state == "missing":
            continue
        if state == "folder":
            os.makedirs(path)
            continue
        if state == "link":  # a link to a copy of the right bytes: still not the file unickpt wrote
            with open(path + ".real", "wb") as f:
                f.write(blob)
            os.symlink(os.path.basename(path) + ".real", path)
            continue
        body = {"exact": blob, "long": blob + b"\0appended", "short": blob[:-1], "empty": b""}[state]
        with open(path, "wb") as f:
            f.write(body)


def _loads(path: str, saved: dict[str, torch.Tensor]) -> bool:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    state = {"model": model, "extra": {}}
    try:
        unickpt.load(path, state, framework="torch")
    except CheckpointError:
        return False
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k  # a load that succeeds returns what was saved
    assert state["extra"] == {"note": "x"}
    return True


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.lists(st.sampled_from(STATES), min_size=2, max_size=2), min_size=1, max_size=3))
def test_issue39_item26_latest_step_list_verify_and_load_agree(template, steps):
    files, data, saved = template
    with tempfile.TemporaryDirectory() as root:
        for s, states in enumerate(steps):
            _build(os.path.join(root, f"step_{s:08d}"), files, data, states + ["exact"] * (len(data) - 2))
        expected = [s for s, states in enumerate(steps) if set(states) <= COMPLETE_STATES]

        m = unickpt.CheckpointManager(root, keep_last=None)
        assert [c.step for c in m.list_checkpoints()] == expected, steps
        assert [st_.step for st_ in m.step_states() if st_.status == "complete"] == expected, steps
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert m.latest_step() == (expected[-1] if expected else None), steps
        for s, states in enumerate(steps):
            path = m.path_for(s)
            storage, md, _ = load_metadata(path)
            report = verify(md, storage)
            assert report.ok == (s in expected), (states, report.failures)
            if "long" in states and s in expected:
                assert report.notes and "never read" in report.notes[0]
            assert _loads(path, saved) == (s in expected), states


class _Written:
    """The two things the commit check asks of a save's plan: its id and each file's planned size."""

    def __init__(self, save_id: str, ends: dict[str, tuple[int, int]]) -> None:
        self.save_id, self._ends = save_id, ends

    def file_ends(self) -> dict[str, tuple[int, int]]:
        return self._ends


def test_issue39_item26_commit_refuses_any_other_size_than_written(tmp_path):
    """The commit is the one stricter check: a file longer than its writer made it holds bytes this
    save did not write, so nothing is published (readers call the same file complete)."""
    from unickpt.engine.save.commit import check_written_files
    from unickpt.errors import MissingDataFileError, StorageError, TruncatedDataFileError
    from unickpt.planning.save.model import data_path
    from unickpt.storage import open_storage

    storage = open_storage(str(tmp_path))
    sid = "s" * 8
    plan = _Written(sid, {"a.bin": (4, 0), "b.bin": (4, 1)})
    for f in ("a.bin", "b.bin"):
        (tmp_path / data_path(sid, f)).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / data_path(sid, f)).write_bytes(b"1234")
    check_written_files(storage, plan)  # exact: committed
    (tmp_path / data_path(sid, "b.bin")).write_bytes(b"12345")
    with pytest.raises(TruncatedDataFileError, match=r"b\.bin \(written by rank 1\) has 5 bytes, not the 4 written"):
        check_written_files(storage, plan)
    (tmp_path / data_path(sid, "b.bin")).unlink()
    os.symlink("a.bin", tmp_path / data_path(sid, "b.bin"))
    with pytest.raises(StorageError):
        check_written_files(storage, plan)
    (tmp_path / data_path(sid, "b.bin")).unlink()
    with pytest.raises(MissingDataFileError, match=r"b\.bin \(written by rank 1\) is missing"):
        check_written_files(storage, plan)
