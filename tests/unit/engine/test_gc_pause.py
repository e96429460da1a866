"""``engine.gc_pause``: the cyclic collector is off while a save or a load builds its per-tensor
records, and afterwards exactly as the job had it (enabled, or disabled by the job itself),
whatever the nesting, the threads and the failures. One pause per public call: never during the
background write and commit of an async save; ``pause_gc=False`` leaves the collector alone."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch import nn

import unickpt
from unickpt.engine.gc_pause import GCHold, gc_paused
from unickpt.errors import FrameworkError
from unickpt.format.records import METADATA_FILE
from unickpt.options import LoadOptions, SaveOptions


@pytest.fixture(autouse=True)
def collector_restored():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_nested_and_overlapping_pauses_restore_the_collector_once():
    with gc_paused():
        assert not gc.isenabled()
        hold = GCHold()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the hold still pauses it
    done = threading.Thread(target=hold.release)  # released by another thread (the save worker)
    done.start()
    done.join()
    assert gc.isenabled()
    hold.release()  # idempotent: no second release of the pause
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_job_that_disabled_the_collector_keeps_it_disabled():
    gc.disable()
    with gc_paused():
        hold = GCHold()
    hold.release()
    assert not gc.isenabled()


def test_the_pause_ends_when_the_block_raises():
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def _state() -> dict:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return {"model": model, "optimizer": optim}


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_and_loads_pause_the_collector_and_restore_it(tmp_path, async_save, monkeypatch):
    from unickpt.engine.load import pipeline as load_pipeline

    seen: dict[str, bool] = {}
    check = load_pipeline.check_targets

    def checked(*a, **k):  # called inside the load's validate stage
        seen["load.validate"] = gc.isenabled()
        return check(*a, **k)

    monkeypatch.setattr(load_pipeline, "check_targets", checked)
    with unickpt.Checkpointer() as ck:
        ck.events.add_listener(lambda e: seen.setdefault(e.phase, gc.isenabled()))
        state = _state()
        ck.save(str(tmp_path / "a"), state, async_save=async_save).wait()
        assert gc.isenabled()
        ck.load(str(tmp_path / "a"), _state())
        assert gc.isenabled()
    assert not seen["save.plan"] and not seen["save.stage"]  # emitted inside the pause
    assert seen["save.write"] is async_save  # a blocking save holds the pause to its commit's end
    assert seen["save.commit"] is async_save  # an async save's background commit: the collector on
    assert not seen["load.validate"]


def _watched(scheme: str) -> list[tuple[bool, bool]]:
    """A local storage under ``scheme://`` recording, at the metadata's publication (its rename
    into place), whether it runs on the main thread and whether the collector is enabled."""
    from unickpt.storage import register_storage
    from unickpt.storage.local import LocalStorage

    seen: list[tuple[bool, bool]] = []

    class Watched(LocalStorage):
        def rename(self, src: str, dst: str) -> None:
            if dst == METADATA_FILE:
                seen.append((threading.current_thread() is threading.main_thread(), gc.isenabled()))
            super().rename(src, dst)

    register_storage(scheme, Watched, replace=True)
    return seen


@pytest.mark.parametrize("async_save", [False, True])
def test_the_background_commit_of_an_async_save_runs_with_the_collector_on(tmp_path, async_save):
    seen = _watched("gcwatch")
    with unickpt.Checkpointer() as ck:
        ck.save(f"gcwatch://{tmp_path}/a", _state(), async_save=async_save).wait()
    ((on_main, enabled),) = seen  # one publication of the metadata
    assert not on_main  # the commit runs on the checkpointer's worker thread
    assert enabled is async_save  # a blocking save pauses to its commit's end, an async one only in the call


def test_pause_gc_false_leaves_the_collector_on(tmp_path, monkeypatch):
    from unickpt.engine.load import pipeline as load_pipeline

    seen: dict[str, bool] = {}
    check = load_pipeline.check_targets

    def checked(*a, **k):  # called inside the load's validate stage
        seen["load.validate"] = gc.isenabled()
        return check(*a, **k)

    monkeypatch.setattr(load_pipeline, "check_targets", checked)
    commits = _watched("gcwatch")
    off = {"save_options": SaveOptions(pause_gc=False), "load_options": LoadOptions(pause_gc=False)}
    with unickpt.Checkpointer(**off) as ck:
        ck.events.add_listener(lambda e: seen.setdefault(e.phase, gc.isenabled()))
        ck.save(f"gcwatch://{tmp_path}/a", _state())  # blocking: would pause to its commit's end
        ck.load(f"gcwatch://{tmp_path}/a", _state())
    assert commits == [(False, True)]
    for phase in ("save.plan", "save.stage", "save.write", "save.commit", "load.validate"):
        assert seen[phase], phase


def test_a_failed_save_restores_the_collector(tmp_path):
    with pytest.raises(FrameworkError):
        unickpt.Checkpointer().save(str(tmp_path / "a"), {"model": nn.Linear(2, 2), "bad key": 1})  # invalid key
    assert gc.isenabled()
    state = {"model": nn.Linear(2, 2).to("meta")}  # refused in the describe stage, inside the pause
    with pytest.raises(FrameworkError, match="meta device"):
        unickpt.Checkpointer().save(str(tmp_path / "b"), state)
    assert gc.isenabled()
