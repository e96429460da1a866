"""``shm://``: checkpoints on the /dev/shm tmpfs, shared by the processes of one machine (issue 14):
the storage contract, and a checkpoint saved by 2 gloo ranks loaded at 1 and 3 bit for bit.

Its tests that start processes are in ``tests/integration/storage/test_shm_processes.py``."""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator

import pytest

from tests.fixtures.contract import StorageContract
from unickpt.errors import UnsafePathError
from unickpt.format.records import METADATA_FILE
from unickpt.storage import open_storage
from unickpt.storage.base import Storage
from unickpt.storage.retry import unwrap
from unickpt.storage.shm import ShmStorage, shm_base


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    shutil.rmtree(os.path.join(shm_base(), name), ignore_errors=True)


class TestShmContract(StorageContract):
    @pytest.fixture
    def backend(self, shm_name: str) -> Callable[[str], Storage]:
        return lambda root: open_storage(f"shm://{shm_name}/{root}")

    @pytest.fixture
    def make_link(self) -> Callable[[Storage, str, str], None]:
        def make(storage: Storage, name: str, target: str) -> None:
            path = os.path.join(unwrap(storage).root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.symlink(target, path)

        return make


def test_issue14_shm_names_cannot_escape():
    for bad in ("", "../x", "a/../../b"):
        with pytest.raises(Exception, match="shm|escapes"):
            ShmStorage(bad)


# ---------------------------------------------------------------- issue 26 item 4: a base of one's own


def _save_tiny(url: str) -> None:
    import torch

    import unickpt

    unickpt.save(url, {"model": torch.nn.Linear(2, 2)}, framework="torch")


@pytest.fixture
def shm_root(tmp_path, monkeypatch) -> str:
    """``UNICKPT_SHM_ROOT`` on a fresh folder: the base ``unickpt-<uid>`` is this test's."""
    root = tmp_path / "shmroot"
    root.mkdir()
    monkeypatch.setenv("UNICKPT_SHM_ROOT", str(root))
    return str(root)


def _refused(base: str, *words: str) -> None:
    with pytest.raises(UnsafePathError) as ei:
        ShmStorage("job/step_1")
    msg = str(ei.value)
    assert base in msg and "remove it" in msg and "UNICKPT_SHM_ROOT" in msg, msg
    for w in words:
        assert w in msg, msg


def test_issue26_shm_base_is_created_0700_and_files_0600(shm_root):
    old = os.umask(0)  # the modes come from unickpt, not from the umask
    try:
        _save_tiny("shm://job/step_1")
    finally:
        os.umask(old)
    base = os.path.join(shm_root, f"unickpt-{os.getuid()}")
    assert shm_base() == base
    assert stat.S_IMODE(os.lstat(base).st_mode) == 0o700
    ckpt = os.path.join(base, "job", "step_1")
    files = [os.path.join(d, n) for d, _, names in os.walk(ckpt) for n in names]
    assert any(f.endswith(METADATA_FILE) for f in files) and any(f.endswith(".bin") for f in files)
    assert {oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files} == {oct(0o600)}
    folders = [os.path.join(d, n) for d, names, _ in os.walk(ckpt) for n in names]
    assert folders and {oct(stat.S_IMODE(os.stat(f).st_mode)) for f in folders} == {oct(0o700)}


def test_issue26_shm_base_of_another_user_is_refused(shm_root):
    base = os.path.join(shm_root, f"unickpt-{os.getuid()}")
    os.mkdir(base, 0o700)
    other = os.getuid() + 4242
    os.chown(base, other, -1)
    _refused(base, f"uid {other}", "another user")
    assert os.listdir(base) == []  # nothing created in it


def test_issue26_shm_base_open_to_others_is_refused(shm_root):
    base = os.path.join(shm_root, f"unickpt-{os.getuid()}")
    os.mkdir(base)
    os.chmod(base, 0o777)
    _refused(base, "0777")
    os.chmod(base, 0o750)
    _refused(base, "0750")
    assert os.listdir(base) == []


def test_issue26_shm_base_that_is_a_link_is_refused(shm_root, tmp_path):
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir(mode=0o700)
    base = os.path.join(shm_root, f"unickpt-{os.getuid()}")
    os.symlink(elsewhere, base)
    _refused(base, "symbolic link")
    assert os.listdir(elsewhere) == []  # no save redirected through it
