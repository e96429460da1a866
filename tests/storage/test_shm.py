"""``shm://``: checkpoints on the /dev/shm tmpfs, shared by the processes of one machine (issue 14):
the storage contract, and a checkpoint saved by 2 gloo ranks loaded at 1 and 3 bit for bit."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator

import pytest
from contract import StorageContract
from s3_workers import load_and_compare, save_replicated

from harness import run_ranks
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


def test_issue14_shm_checkpoint_shared_by_ranks_of_one_machine(shm_name):
    url = f"shm://{shm_name}/step_1"
    assert isinstance(unwrap(open_storage(url)), ShmStorage)
    run_ranks(save_replicated, 2, url, 4)
    assert os.path.isfile(os.path.join(shm_base(), shm_name, "step_1", "unickpt.metadata.json"))
    assert run_ranks(load_and_compare, 1, url, 4) == [[]]
    assert run_ranks(load_and_compare, 3, url, 4) == [[], [], []]


def test_issue14_shm_names_cannot_escape():
    for bad in ("", "../x", "a/../../b"):
        with pytest.raises(Exception, match="shm|escapes"):
            ShmStorage(bad)
