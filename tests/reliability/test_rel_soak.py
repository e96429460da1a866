"""Soak: 200 asynchronous saves through CheckpointManager(keep_last=3) while a small model
trains in the same process. Every kept checkpoint loads bit-exact to the state of its step; RSS,
file descriptors and threads stay flat after warm-up. Prints the measured numbers."""

from __future__ import annotations

import gc
import os
import threading
import time

import psutil

import unickpt
from tests.support.reference import full_state
from tests.workers.rel_helpers import mismatches
from unickpt.testing.toy import build, train_step

SAVES = 200
WARMUP = 20
KEEP = 3
RSS_BOUND = 48 << 20  # growth allowed after warm-up (allocator noise; a leak of one snapshot
#                       per save would be ~0.5 MB x 180 = 90 MB)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _verify_kept(manager, snaps) -> int:
    kept = manager.list_checkpoints()
    assert [c.step for c in kept] == sorted(snaps)[-KEEP:], ([c.step for c in kept], sorted(snaps)[-KEEP:])
    for c in kept:
        model, optim = build("torch", seed=4321)
        state = {"model": model, "optimizer": optim, "extra_state": None}
        unickpt.load(c.path, state, framework="torch")
        assert not mismatches(full_state(model, optim), snaps[c.step]), c.step
        assert state["extra_state"] == {"step": c.step}
    return len(kept)


def test_soak_200_async_saves(tmp_path):
    manager = unickpt.CheckpointManager(str(tmp_path / "run"), keep_last=KEEP)
    model, optim = build("torch", seed=0)
    proc = psutil.Process()
    snaps: dict[int, dict] = {}
    verified = 0
    t0 = time.perf_counter()
    base = None
    for s in range(1, SAVES + 1):
        train_step(model, optim, s)
        manager.save(
            s, {"model": model, "optimizer": optim, "extra_state": {"step": s}}, framework="torch", async_save=True
        )
        snaps[s] = full_state(model, optim)  # the state this save snapshotted
        for old in [k for k in snaps if k <= s - KEEP - 2]:
            del snaps[old]
        if s == WARMUP:
            manager.wait()
            gc.collect()
            base = (proc.memory_info().rss, _fds(), threading.active_count())
        if s % 50 == 0:
            manager.wait()
            verified += _verify_kept(manager, snaps)
    manager.wait()
    seconds = time.perf_counter() - t0
    gc.collect()
    end = (proc.memory_info().rss, _fds(), threading.active_count())
    assert base is not None
    print(
        f"\nsoak: {SAVES} async saves in {seconds:.1f}s ({seconds / SAVES * 1000:.0f} ms/save incl. "
        f"training), {verified} kept checkpoints verified bit-exact; RSS {base[0] / 2**20:.1f} -> "
        f"{end[0] / 2**20:.1f} MiB, fds {base[1]} -> {end[1]}, threads {base[2]} -> {end[2]}"
    )
    assert end[0] - base[0] < RSS_BOUND, (base, end)
    assert end[1] <= base[1], (base, end)  # no descriptor leak
    assert end[2] <= base[2], (base, end)  # no thread leak
    assert sorted(os.listdir(tmp_path / "run")) == ["latest"] + [
        f"step_{s:08d}" for s in range(SAVES - KEEP + 1, SAVES + 1)
    ]
    assert manager.latest_step() == SAVES
