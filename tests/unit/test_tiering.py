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


def test_issue40_item2_copy_checkpoint_raises_error_families(tmp_path):
    """``copy_checkpoint``'s refusals are families, not the bare root: a destination holding a
    checkpoint is the caller's set-up (ConfigurationError), a source without its metadata or a
    data file is a copy missing a file (MissingDataFileError, an IntegrityError)."""
    from unickpt.storage import open_storage
    from unickpt.tiering import copy_checkpoint

    src, dst = tmp_path / "src", tmp_path / "dst"
    unickpt.save(str(src), {"model": _model(0)})
    unickpt.save(str(dst), {"model": _model(1)})
    with pytest.raises(unickpt.ConfigurationError, match="holds a checkpoint already"):
        copy_checkpoint(open_storage(str(src)), open_storage(str(dst)))
    with pytest.raises(unickpt.MissingDataFileError, match="no committed checkpoint to copy"):
        copy_checkpoint(open_storage(str(tmp_path / "empty")), open_storage(str(tmp_path / "new")))
    data = sorted(os.path.join(d, f) for d, _, fs in os.walk(src / "data") for f in fs if f.endswith(".bin"))
    os.unlink(data[0])
    with pytest.raises(unickpt.IntegrityError, match="is missing: the fast copy is incomplete"):
        copy_checkpoint(open_storage(str(src)), open_storage(str(tmp_path / "new2")))


def test_issue40_item2_load_latest_keeps_the_type_of_the_error_that_hid_the_latest_step(tmp_path):
    """``CheckpointManager.load_latest`` re-raises what stopped it finding the latest step with
    that error's own type (so its family), not the bare root: a planted link as ``latest`` is the
    storage's ``UnsafePathError``, an oversized one a ``SizeLimitError``."""
    root = tmp_path / "run"
    manager = unickpt.CheckpointManager(str(root))
    root.mkdir(exist_ok=True)
    (tmp_path / "elsewhere").write_text("3")
    (root / "latest").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(unickpt.UnsafePathError, match=f"cannot find the latest checkpoint under {root}: .*link"):
        manager.load_latest({})
    (root / "latest").unlink()
    (root / "latest").write_bytes(b"x" * (1 << 20))
    with pytest.raises(unickpt.SizeLimitError, match=f"cannot find the latest checkpoint under {root}: "):
        manager.load_latest({})
