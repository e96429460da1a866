"""Async save semantics: the checkpoint is the state at the save call, errors surface, the
staging pool is bounded and reused, plans are cached and never stale."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unickpt
from unickpt.errors import CheckpointError, StorageError
from unickpt.storage.local import LocalStorage


def _model(seed: int = 0, width: int = 64) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 32)).sum().backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def _snapshot(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _load(path: str, width: int = 64) -> nn.Module:
    m, opt = _model(seed=99, width=width)
    unickpt.load(path, {"model": m, "optimizer": opt})
    return m


def _held_background_copy(monkeypatch, seconds: float = 0.3):
    """Hold the snapshot thread's copy until the returned event is set (or ``seconds`` pass),
    so that what the test does right after the save call surely overlaps the copy."""
    import threading

    from unickpt.engine.save import staging

    real = staging._copy_entries
    go = threading.Event()

    def held(*args, **kwargs):
        if threading.current_thread().name.startswith("unickpt-snapshot"):
            go.wait(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(staging, "_copy_entries", held)
    return go


def test_checkpoint_is_the_state_at_the_save_call(tmp_path, monkeypatch):
    """Training goes on right after the call (forward, backward, optimizer.step): the step waits
    for the background copy of parameters and optimizer state; buffers, which forward changes,
    were copied in the call."""
    _held_background_copy(monkeypatch)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(2):
        m(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    before = _snapshot(m)
    before_opt = {k: v.clone() for k, v in opt.state[m[0].weight].items()}
    h = unickpt.save(str(tmp_path / "c"), {"model": m, "optimizer": opt}, async_save=True)
    for _ in range(3):
        m(torch.randn(16, 32)).square().mean().backward()  # updates BatchNorm's running stats
        opt.step()
        assert h._snapshot is not None and h._snapshot.done()  # the step waited for the copy
        opt.zero_grad()
    h.wait()
    assert not torch.equal(m[0].weight, before["0.weight"])
    m2 = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    unickpt.load(str(tmp_path / "c"), {"model": m2, "optimizer": opt2})
    got = m2.state_dict()
    assert all(torch.equal(got[k], before[k]) for k in before)
    assert all(torch.equal(opt2.state[m2[0].weight][k], v) for k, v in before_opt.items())


def test_in_place_changes_outside_the_step(tmp_path, monkeypatch):
    """Changing parameters in place outside optimizer.step(): fine after wait_snapshot() or with
    background_snapshot=False; during the background copy the save is refused, never torn."""
    m, opt = _model()
    for mode in ("call-copy", "wait_snapshot", "conflict"):
        go = _held_background_copy(monkeypatch, seconds=30)
        before = _snapshot(m)
        path = str(tmp_path / mode)
        options = unickpt.SaveOptions(background_snapshot=mode != "call-copy")
        h = unickpt.save(path, {"model": m, "optimizer": opt}, async_save=True, options=options)
        assert (h._snapshot is None) == (mode == "call-copy")
        if mode == "wait_snapshot":
            go.set()
            h.wait_snapshot()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        go.set()
        if mode == "conflict":
            with pytest.raises(unickpt.SnapshotConflictError, match="modified in place.*wait_snapshot"):
                h.wait()
            with pytest.raises((unickpt.IncompleteCheckpointError, unickpt.NotACheckpointError)):
                _load(path)
            continue
        h.wait()
        got = _load(path).state_dict()
        assert all(torch.equal(got[k], before[k]) for k in before), mode


def test_background_error_surfaces_in_wait_and_in_next_save(tmp_path, monkeypatch):
    m, opt = _model()
    real_write = LocalStorage.write

    def failing(self, name, parts):
        raise StorageError(f"injected failure writing {name}")

    monkeypatch.setattr(LocalStorage, "write", failing)
    h = unickpt.save(str(tmp_path / "a"), {"model": m, "optimizer": opt}, async_save=True)
    with pytest.raises(CheckpointError, match="injected failure writing data/"):
        h.wait()
    unickpt.save(str(tmp_path / "b"), {"model": m, "optimizer": opt}, async_save=True)  # fails, unseen
    unickpt.default_checkpointer().resources.worker.drain()
    monkeypatch.setattr(LocalStorage, "write", real_write)
    with pytest.raises(CheckpointError, match="previous asynchronous save failed"):
        unickpt.save(str(tmp_path / "c"), {"model": m, "optimizer": opt})
    unickpt.save(str(tmp_path / "c"), {"model": m, "optimizer": opt})  # reported once, then clean
    # nothing was committed at the failed path (its partial data may already be cleaned up)
    with pytest.raises((unickpt.IncompleteCheckpointError, unickpt.NotACheckpointError)):
        _load(str(tmp_path / "a"))


def test_back_to_back_async_saves_commit_in_order_with_bounded_pool(tmp_path):
    m, opt = _model(width=256)
    states = []
    handles = []
    for i in range(4):
        if handles:
            handles[-1].wait_snapshot()  # in-place changes outside optimizer.step() wait for it
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.5)
        states.append(_snapshot(m))
        handles.append(unickpt.save(str(tmp_path / f"s{i}"), {"model": m, "optimizer": opt}, async_save=True))
    mds = [h.wait() for h in handles]
    for i, _md in enumerate(mds):
        got = _load(str(tmp_path / f"s{i}"), width=256).state_dict()
        assert all(torch.equal(got[k], states[i][k]) for k in states[i])
    rank_bytes = sum(s.byte_length for t in mds[0].tensors.values() for s in t.shards)
    assert (
        unickpt.default_checkpointer().resources.staging.capacity_bytes() <= 2 * rank_bytes + 2 * 3 * 4096 * 4
    )  # 2 slots, page rounding


def test_plan_cache_reused_and_invalidated(tmp_path):
    events = []

    def listen(ev):
        if ev.phase == "save.plan":
            events.append(ev)

    unickpt.default_checkpointer().events.add_listener(listen)
    try:
        m, opt = _model()
        md1 = unickpt.save(str(tmp_path / "x"), {"model": m, "optimizer": opt}).wait()
        md2 = unickpt.save(str(tmp_path / "y"), {"model": m, "optimizer": opt}).wait()
        assert md2.save_id.startswith(md1.save_id) and md2.save_id != md1.save_id
        m3, opt3 = _model(width=48)  # a different layout: never reuse the stale plan
        md3 = unickpt.save(str(tmp_path / "z"), {"model": m3, "optimizer": opt3}).wait()
        assert not md3.save_id.startswith(md1.save_id)
        assert md3.tensors["model.0.weight"].shape == (48, 32)
        got = _load(str(tmp_path / "z"), width=48).state_dict()
        assert torch.equal(got["0.weight"], m3.state_dict()["0.weight"])
    finally:
        unickpt.default_checkpointer().events.remove_listener(listen)
    assert len(events) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_async_snapshot_round_trip(tmp_path):
    """Pinned staging + side-stream D2H at save, H2D at load: the snapshot is the state at the
    call even though the next kernels modify the tensors at once."""
    m, _ = _model()
    m.cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 32, device="cuda")).sum().backward()
    opt.step()
    before = _snapshot(m)
    h = unickpt.save(str(tmp_path / "g"), {"model": m, "optimizer": opt}, async_save=True)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)
    h.wait()
    m2, _ = _model(seed=5)
    m2.cuda()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    unickpt.load(str(tmp_path / "g"), {"model": m2, "optimizer": opt2})
    assert all(torch.equal(m2.state_dict()[k], before[k]) for k in before)


def test_pinned_staging_buffers_of_different_sizes_are_reused_by_identity():
    """Found on an H100: with two files of different sizes, the second CUDA save picked its
    pinned buffer and removed it from the pool with ``list.remove``, which compares tensors with
    ``==`` (an element-wise comparison of buffers of different sizes: RuntimeError). Plain
    tensors stand in for pinned ones (``_fit`` tells them apart by type, not by pinning)."""
    from unickpt.engine.save.staging import _fit, _Slot

    small, large = torch.empty(100, dtype=torch.uint8), torch.empty(5000, dtype=torch.uint8)
    slot = _Slot(buffers=[large, small])
    _fit(slot, [5000, 100], pinned=True)
    assert slot.buffers[0] is large and slot.buffers[1] is small


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("async_save", [True, False])
def test_cuda_saves_reuse_pinned_buffers_across_files(tmp_path, async_save):
    """Three CUDA saves (async, or blocking: both stage through the pinned images) into two files
    of different sizes each: later saves reuse the pinned buffers, and all load back bit-exact."""
    m, _ = _model()
    m.cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 32, device="cuda")).sum().backward()
    opt.step()
    opts = unickpt.SaveOptions(files_per_rank=2)
    for name in ("a", "b", "c"):
        want = _snapshot(m)
        unickpt.save(str(tmp_path / name), {"model": m, "optimizer": opt}, async_save=async_save, options=opts).wait()
        m2, _ = _model(seed=5)
        m2.cuda()
        opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
        unickpt.load(str(tmp_path / name), {"model": m2, "optimizer": opt2})
        assert all(torch.equal(m2.state_dict()[k], want[k]) for k in want)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)


def test_issue10_item3_plan_cache_keyed_on_files_per_rank(tmp_path):
    """Same layout, another files_per_rank: the plan is made anew, never reused from the cache."""
    m, opt = _model()
    want = _snapshot(m)
    for n in (2, 3):
        md = unickpt.save(
            str(tmp_path / f"f{n}"), {"model": m, "optimizer": opt}, options=unickpt.SaveOptions(files_per_rank=n)
        ).wait()
        assert len(md.files) == n, (n, md.files)
        got = _load(str(tmp_path / f"f{n}")).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_issue10_item4_every_failed_async_save_is_reported(tmp_path, monkeypatch):
    """Two async saves fail and nobody waits on them: the next call raises one error naming both
    (each with its path and cause, the first cause chained), then the slate is clean."""
    m, opt = _model()
    real_write = LocalStorage.write

    def failing(self, name, parts):
        raise StorageError(f"injected failure writing {self.root}/{name}")

    monkeypatch.setattr(LocalStorage, "write", failing)
    for name in ("a", "b"):
        unickpt.save(str(tmp_path / name), {"model": m, "optimizer": opt}, async_save=True)
    unickpt.default_checkpointer().resources.worker.drain()
    monkeypatch.setattr(LocalStorage, "write", real_write)
    with pytest.raises(unickpt.AsyncSaveFailures) as info:
        unickpt.save(str(tmp_path / "c"), {"model": m, "optimizer": opt})
    err = info.value
    assert [p for p, _ in err.failures] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert all(isinstance(c, StorageError) for _, c in err.failures)
    assert err.__cause__ is err.failures[0][1]
    msg = str(err)
    assert "2 previous asynchronous saves failed" in msg
    assert (
        f"injected failure writing {tmp_path}/a/data/" in msg and f"injected failure writing {tmp_path}/b/data/" in msg
    )
    unickpt.save(str(tmp_path / "c"), {"model": m, "optimizer": opt})  # reported once, then clean
    unickpt.wait_all()  # nothing left to report
