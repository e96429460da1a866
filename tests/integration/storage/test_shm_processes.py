"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/storage/test_shm.py``, which holds its single-process tests."""

from __future__ import annotations

import os

from tests.unit.storage.test_shm import shm_name  # noqa: F401 (a fixture)
from tests.workers.harness import run_ranks
from tests.workers.s3_workers import load_and_compare, save_replicated
from unickpt.storage import open_storage
from unickpt.storage.retry import unwrap
from unickpt.storage.shm import ShmStorage, shm_base


def test_issue14_shm_checkpoint_shared_by_ranks_of_one_machine(shm_name):  # noqa: F811 (a fixture)
    url = f"shm://{shm_name}/step_1"
    assert isinstance(unwrap(open_storage(url)), ShmStorage)
    run_ranks(save_replicated, 2, url, 4)
    assert os.path.isfile(os.path.join(shm_base(), shm_name, "step_1", "unickpt.metadata.json"))
    assert run_ranks(load_and_compare, 1, url, 4) == [[]]
    assert run_ranks(load_and_compare, 3, url, 4) == [[], [], []]
