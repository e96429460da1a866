"""The tests that start processes of the async save's staging pool (``engine.save.staging``).

Issue 39 item 27 (a heap corruption seen once in the crash matrix): an async save whose lock
stage refuses it (``run_locked``'s ``on_refused``) returned its staging slot while the snapshot
thread was still copying the optimizer state into the slot's file images; the next async save
of another layout took that slot and freed (munmapped) those images under the running copy,
which then wrote into unmapped memory (SIGSEGV), or into memory handed out again since (a
corrupted heap, or another tensor's bytes). The save runs in a child process: on the old code it
dies by SIGSEGV, which must not take the test runner down.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import unickpt
from tests.workers.harness import run_jobs, run_ranks

SIDE = 4096  # a 64 MiB weight: its AdamW snapshot (weight, exp_avg, exp_avg_sq) is a 192 MiB copy


def _refused_then_other_layout(rank: int, ws: int, root: str, rounds: int) -> list[bool]:
    """Each round: an async save refused at its lock stage (a folder holding a file of the
    user's), at once an async save of another layout, then one of the first layout again, loaded
    back into fresh objects; whether each round's load is bit-exact."""
    torch.manual_seed(0)
    model = torch.nn.Linear(SIDE, SIDE, bias=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, SIDE)).sum().backward()
    optim.step()
    optim.zero_grad()
    foreign = os.path.join(root, "foreign")
    os.makedirs(foreign)
    with open(os.path.join(foreign, "notes.txt"), "w") as f:
        f.write("the user's own file: not a unickpt folder")
    other = torch.nn.Linear(8, 8)
    exact = []
    for r in range(rounds):
        refused = unickpt.save(foreign, {"model": model, "optimizer": optim}, async_save=True)
        try:
            refused.wait()  # returns (raises) while its optimizer copy may still run
        except unickpt.CheckpointError:
            pass
        unickpt.save(os.path.join(root, f"other{r}"), {"model": other}, async_save=True).wait()
        path = os.path.join(root, f"same{r}")
        unickpt.save(path, {"model": model, "optimizer": optim}, async_save=True).wait()
        back = torch.nn.Linear(SIDE, SIDE, bias=False)
        back_optim = torch.optim.AdamW(back.parameters(), lr=1e-3)
        unickpt.load(path, {"model": back, "optimizer": back_optim})
        want, got = optim.state[model.weight], back_optim.state[back.weight]
        exact.append(
            torch.equal(back.weight, model.weight)
            and all(torch.equal(got[k], want[k]) for k in ("exp_avg", "exp_avg_sq"))
        )
    return exact


def test_issue39_item27_refused_async_save_keeps_its_images_until_its_copy_ends(tmp_path):
    (job,) = run_jobs([(_refused_then_other_layout, (str(tmp_path), 3))], timeout=300)
    # old code: the child dies by SIGSEGV in the snapshot thread's copy (exit code -11)
    assert job.exitcode == 0 and job.status == "ok", job
    assert job.result == [True, True, True]


def _stage_fails_twice_on_rank1(rank: int, ws: int, root: str) -> list[str]:
    """Three async saves; the staging of the first two fails on rank 1 only (injected), so rank 0
    staged into a slot for a save that every rank then abandons. What each save did."""
    from tests.workers.rel_helpers import tiny_model
    from unickpt.engine.save import staging

    model, optim = tiny_model(seed=5)
    if rank == 1:
        real, calls = staging.StagingPool.stage, [0]

        def failing(self: Any, *a: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] <= 2:
                raise unickpt.CheckpointError("injected: staging failed on rank 1")
            return real(self, *a, **kw)

        staging.StagingPool.stage = failing  # type: ignore[method-assign]
    out = []
    for i in range(3):
        try:
            state = {"model": model, "optimizer": optim}
            unickpt.save(f"{root}/s{i}", state, framework="ddp", async_save=True).wait()
            out.append("committed")
        except unickpt.CheckpointError as e:
            out.append(type(e).__name__)
    return out


def test_issue39_item27_a_stage_failed_on_another_rank_returns_this_ranks_slot(tmp_path):
    """Rank 0's images of a save that rank 1 failed to stage go back to the pool (they were never
    released: after two such saves rank 0 had no slot left and its next async save waited forever)."""
    results = run_ranks(_stage_fails_twice_on_rank1, 2, str(tmp_path), timeout=120)
    assert results[0][2] == results[1][2] == "committed", results
    assert results[0][:2] == results[1][:2] and "committed" not in results[0][:2], results


def _image_freed_under_a_running_copy(rank: int, ws: int) -> bool:
    """Stage a 64 MiB tensor whose copy is deferred to the (held) snapshot thread, hand the slot
    back early (as any ordering bug would) and stage another layout into it, which frees the
    first images (``_fit``); then let the copy run. Whether the first images hold the tensor."""
    import threading

    from unickpt.engine.save.staging import StagingPool
    from unickpt.planning.save import RankSavePlan, WriteEntry
    from unickpt.planning.specs import SaveItem, ShardSpec

    def item(n: int, seed: int) -> tuple[list[SaveItem], RankSavePlan]:
        t = torch.arange(n, dtype=torch.float32) + seed
        spec = ShardSpec("w", "float32", (n,), (0,), (n,))
        return [SaveItem(spec, t)], RankSavePlan(0, f"s{seed}", (WriteEntry(0, "f", 0, 4 * n),))

    pool = StagingPool(slots=1)
    gate = threading.Event()
    pool._snapshotter.submit(gate.wait)  # the snapshot thread is busy: the copy below waits
    big, big_plan = item(SIDE * SIDE, 1)
    first = pool.stage(big, big_plan, {}, later=lambda i: True)
    pool._release(first._slot)  # out of order: the copy has not run yet
    small, small_plan = item(1000, 2)
    second = pool.stage(small, small_plan, {})  # another layout: frees the first images
    gate.set()
    first.wait_ready()  # the copy into the freed images; old code: SIGSEGV (or a heap written over)
    got = torch.frombuffer(bytearray(first.parts["f"][0]), dtype=torch.float32)
    second.release()
    pool.close()
    return bool(torch.equal(got, big[0].tensor))


def test_issue39_item27_an_image_freed_under_a_running_copy_stays_mapped_until_the_copy_ends(tmp_path):
    """The pool's images are ``torch.frombuffer`` views of mmaps, and such a tensor keeps no
    buffer export: ``mmap.close()`` unmapped the pages under it. An image the pool frees now goes
    with its last view, so an ordering bug of the pool can no longer make a copy write into
    unmapped or reused memory."""
    (job,) = run_jobs([(_image_freed_under_a_running_copy, ())], timeout=300)
    # old code: the child dies by SIGSEGV in the snapshot thread's copy (exit code -11)
    assert job.exitcode == 0 and job.status == "ok", job
    assert job.result is True
