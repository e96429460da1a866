"""Hot/cold tiering (issue 14): saves land on a fast tier (shm://), are copied to a durable tier in
the background, verified there before the fast copy may go; load finds either tier; a durable
copy that fails verification is never published and the fast copy stays.

Its tests that start processes are in ``tests/integration/storage/test_tiering_processes.py``."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
import torch
from torch import nn

import unickpt
from unickpt.storage import register_storage
from unickpt.storage.local import LocalStorage
from unickpt.storage.shm import shm_base


@pytest.fixture
def fast_root():
    name = f"tier-{uuid.uuid4().hex[:12]}"
    yield f"shm://{name}"
    shutil.rmtree(os.path.join(shm_base(), name), ignore_errors=True)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def _values(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_issue14_tiering_copies_verifies_and_frees_the_fast_tier(tmp_path, fast_root):
    durable = str(tmp_path / "durable")
    tiers = unickpt.TieredCheckpointManager(fast_root, durable, keep_fast=1)
    model = _model(0)
    want = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            model[0].bias.add_(1.0)
        want[step] = _values(model)
        tiers.save(step, {"model": model}, async_save=(step == 2)).wait_snapshot()
    tiers.wait()
    assert [c.step for c in tiers.durable.list_checkpoints()] == [1, 2, 3]
    assert [c.step for c in tiers.fast.list_checkpoints()] == [3]  # older fast copies freed
    for step in (1, 2, 3):
        fresh = _model(9)
        unickpt.load(tiers.durable.path_for(step), {"model": fresh})
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want[step].items()), step
    fresh = _model(9)
    assert tiers.load_latest({"model": fresh}) == 3 and tiers.latest_step() == (3, "fast")
    shutil.rmtree(os.path.join(shm_base(), fast_root[len("shm://") :]))  # the node's memory is gone
    fresh = _model(9)
    assert tiers.load_latest({"model": fresh}) == 3 and tiers.latest_step() == (3, "durable")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want[3].items())
    tiers.close()


class _FlipsOneByte(LocalStorage):
    """A durable tier that corrupts what it stores (one flipped byte per data file)."""

    def write(self, name, parts):
        data = bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts))
        if name.startswith("data/") and data:
            data[len(data) // 2] ^= 0xFF
        super().write(name, [data])


def test_issue14_a_corrupt_durable_copy_is_never_published(tmp_path, fast_root):
    register_storage("flipbytes", lambda path, options: _FlipsOneByte("/" + path, options), replace=True)
    durable = f"flipbytes://{tmp_path}/durable"
    tiers = unickpt.TieredCheckpointManager(fast_root, durable, keep_fast=1)
    model = _model(1)
    tiers.save(1, {"model": model})
    tiers.save(2, {"model": model})
    with pytest.raises(unickpt.AsyncSaveFailures, match="ChecksumMismatch|failed verification"):
        tiers.wait()
    assert tiers.durable.list_checkpoints() == []
    assert [c.step for c in tiers.fast.list_checkpoints()] == [1, 2]  # nothing dropped unverified
    tiers._copier.shutdown(wait=True)
