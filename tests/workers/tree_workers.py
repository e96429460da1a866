"""Functions run on spawned gloo ranks by test_tree_coordination.py (module level, so that
``spawn`` can import them). Each returns a summary of what its rank saw, in plain values."""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Any

import torch

import unickpt

WAIT = datetime.timedelta(seconds=120)


def _tree_options(ranks_per_host: int) -> unickpt.CoordinationOptions:
    return unickpt.CoordinationOptions(tree_min_world_size=2, fan_out=2, ranks_per_host=ranks_per_host)


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Layers of different sizes: the save plan's balancing of replicated tensors has choices."""
    torch.manual_seed(seed)
    widths = [8, 24, 16, 40, 12, 32, 4]
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, widths[0])).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _value(rank: int) -> dict[str, Any]:
    return {"rank": rank, "tag": "x" * (rank % 3), "nested": [rank, (rank, str(rank))]}


def _collectives(c: Any) -> dict[str, Any]:
    ws = c.world_size
    out: dict[str, Any] = {}
    out["all_gather"] = c.all_gather_object(_value(c.rank))
    out["gather"] = c.gather_object(_value(c.rank))
    out["gather_dst3"] = c.gather_object(c.rank * 10, dst=3)
    out["broadcast"] = c.broadcast_object({"from": c.rank} if c.rank == 0 else None)
    out["broadcast_src5"] = c.broadcast_object(c.rank if c.rank == 5 else None, src=5)
    out["scatter"] = c.scatter_object([_value(r) for r in range(ws)] if c.rank == 0 else None)
    out["scatter_src7"] = c.scatter_object(list(range(100, 100 + ws)) if c.rank == 7 else None, src=7)
    c.barrier()
    out["after_barrier"] = c.all_gather_object(c.rank)
    return out


def _plan_summary(ckpt: unickpt.Checkpointer, framework: str) -> dict[str, Any]:
    from unickpt.engine.plan_cache import PlanKey

    cached = ckpt.resources.plans.get(PlanKey(None, framework, 2))
    assert cached is not None
    sid = cached.save_id

    def entries(rp: Any) -> list[Any]:
        return [
            (e.item_index, e.file.replace(sid, "SID"), e.byte_offset, e.byte_length, e.blob_key) for e in rp.entries
        ]

    out: dict[str, Any] = {"mine": entries(cached.mine)}
    g = cached.coordinator
    if g is not None:
        out["global"] = {
            "rank_plans": [entries(rp) for rp in g.rank_plans],
            "files": [f.replace(sid, "SID") for f in g.files],
            "writers": [list(w) for w in g.writers],
        }
    return out


def tree_vs_flat(rank: int, ws: int, base: str) -> dict[str, Any]:
    """The same collectives and the same saves through a tree checkpointer (2 "hosts" of 4
    ranks, fan-out 2) and a flat one; then each loads the other's checkpoint."""
    from unickpt.coordination.tree import TreeCoordinator

    tree = unickpt.Checkpointer(coordination=_tree_options(4))
    flat = unickpt.Checkpointer(coordination=unickpt.CoordinationOptions(tree_min_world_size=ws + 1))
    tc = tree.resources.coordinator("foreground", None, "tree test")
    fc = flat.resources.coordinator("foreground", None, "flat test")
    out: dict[str, Any] = {"kinds": [type(tc).__name__, type(fc).__name__]}
    assert isinstance(tc, TreeCoordinator)
    out["layout"] = tc.layout.describe()
    out["tree"], out["flat"] = _collectives(tc), _collectives(fc)

    model, optim = _model(seed=1)
    state = {"model": model, "optimizer": optim, "extra_state": {"rank": rank, "step": 7}}
    tree.save(f"{base}/tree", state, framework="ddp")
    flat.save(f"{base}/flat", state, framework="ddp")
    out["plans"] = {"tree": _plan_summary(tree, "ddp"), "flat": _plan_summary(flat, "ddp")}
    tree.save(f"{base}/tree", state, framework="ddp", async_save=True).wait()  # the cached plan, async
    exact = {}
    for name, ckpt, path in (("tree<-flat", tree, "flat"), ("flat<-tree", flat, "tree")):
        m2, o2 = _model(seed=99)
        loaded = {"model": m2, "optimizer": o2, "extra_state": None}
        ckpt.load(f"{base}/{path}", loaded, framework="ddp")
        same = all(torch.equal(a, b) for a, b in zip(m2.state_dict().values(), model.state_dict().values()))
        same = same and all(
            torch.equal(o2.state[p]["exp_avg"], optim.state[q]["exp_avg"])
            for p, q in zip(m2.parameters(), model.parameters())
        )
        exact[name] = same and loaded["extra_state"] == {"rank": rank, "step": 7}
    out["load_exact"] = exact
    # hosts from host names (one machine: one host), and options that differ between ranks
    named = unickpt.Checkpointer(coordination=unickpt.CoordinationOptions(tree_min_world_size=2, fan_out=2))
    nc = named.resources.coordinator("foreground", None, "named")
    out["named"] = {"layout": nc.layout.describe(), "all_gather": nc.all_gather_object(_value(rank))}
    odd = unickpt.CoordinationOptions(tree_min_world_size=2, fan_out=3 if rank == 5 else 2, ranks_per_host=4)
    try:
        unickpt.Checkpointer(coordination=odd).resources.coordinator("foreground", None, "odd options")
        out["odd"] = None
    except unickpt.CheckpointError as e:
        out["odd"] = {"type": type(e).__name__, "msg": str(e)}
    for c in (tree, flat, named):
        c.close()
    return out


def held_commit(rank: int, ws: int, base: str) -> dict[str, Any]:
    """The tree from the environment (the default checkpointer); rank 2's write is held (after its
    first data file) until rank 0 has written and entered the commit barrier. Rank 0 records, at
    the moment it publishes the metadata, whether rank 2 had reported."""
    from torch.distributed.distributed_c10d import _get_default_store  # test-only private use

    from unickpt.coordination.tree import TreeCoordinator
    from unickpt.format.records import METADATA_FILE
    from unickpt.storage import register_storage
    from unickpt.storage.local import LocalStorage

    os.environ.update(UNICKPT_TREE_MIN_WORLD_SIZE="2", UNICKPT_TREE_FAN_OUT="2", UNICKPT_RANKS_PER_HOST="2")
    store = _get_default_store()
    seen: dict[str, Any] = {}

    class Watched(LocalStorage):
        def rename(self, src: str, dst: str) -> None:
            if dst == METADATA_FILE:  # the publication of the metadata: the commit
                seen["rank 2 reported before the commit"] = store.check(["rank2-reports"])
                seen["rank 2 released before the commit"] = store.check(["rank0-in-barrier"])
            super().rename(src, dst)

    register_storage("watched", Watched, replace=True)
    ckpt = unickpt.default_checkpointer()

    def listener(ev: Any) -> None:
        if ev.rank == 2 and ev.phase == "save.write.file" and "held" not in seen:
            seen["held"] = True
            store.wait(["rank0-in-barrier"], WAIT)  # rank 2 holds its write here
        elif ev.rank == 2 and ev.phase == "save.commit.begin":
            store.set("rank2-reports", "1")  # rank 2 wrote everything; it reports next
        elif ev.rank == 0 and ev.phase == "save.commit.begin":
            store.set("rank0-in-barrier", "1")  # rank 0 wrote everything; it waits for the others next

    model, optim = _model(seed=2)
    ckpt.events.add_listener(listener)
    md = unickpt.save(f"watched://{base}/held", {"model": model, "optimizer": optim}, framework="ddp").wait()
    seen["coordinator"] = type(ckpt.resources.coordinator("background", None, "check")).__name__
    seen["committed"] = md is not None if rank == 0 else None
    seen["is_tree"] = isinstance(ckpt.resources.coordinator("foreground", None, "check"), TreeCoordinator)
    return seen


def killed_in_save(
    rank: int, ws: int, base: str, victim: int, phase: str, timeout: float, snap_file: str
) -> dict[str, Any]:
    """Commit one checkpoint, then ``victim`` SIGKILLs itself at ``phase`` of the next save
    (``save.write.file``: in the middle of its write, after its first data file; ``save.begin``:
    before the first collective), over the tree (2 "hosts" of 2 ranks). The others report the
    error they raised and how long it took."""
    ckpt = unickpt.Checkpointer(coordination=_tree_options(2))
    model, optim = _model(seed=3)
    path = f"{base}/ckpt"
    ckpt.save(path, {"model": model, "optimizer": optim}, framework="ddp")
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, snap_file)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next save differs from the committed one

    def listener(ev: Any) -> None:
        if rank == victim and ev.phase == phase:
            os.kill(os.getpid(), signal.SIGKILL)

    ckpt.events.add_listener(listener)
    t0 = time.monotonic()
    opts = unickpt.SaveOptions(timeout=timeout)
    try:
        ckpt.save(path, {"model": model, "optimizer": optim}, framework="ddp", options=opts)
        return {"type": None}
    except unickpt.CheckpointError as e:
        return {
            "type": type(e).__name__,
            "msg": str(e),
            "missing": list(getattr(e, "missing_ranks", ())),
            "seconds": time.monotonic() - t0,
        }


def fsdp2_regular(rank: int, ws: int, base: str) -> dict[str, Any]:
    """FSDP2 (every parameter ``Shard(0)`` over the job, 0-d optimizer steps replicated) saved
    through a tree and a flat checkpointer: rank 0 plans it as a regular job (templates of
    ranks, ``planning.save.templates``), both give each rank the same part, a second (cached,
    async) save renames it, and each checkpoint loads bit-exact through the other."""
    from tests.support.reference import full_state
    from unickpt.planning.save.templates import RegularRankPlans
    from unickpt.testing.toy import build, train_step

    model, optim = build("fsdp2", seed=0)
    train_step(model, optim, 0)
    want = full_state(model, optim)
    tree = unickpt.Checkpointer(coordination=_tree_options(4))
    flat = unickpt.Checkpointer(coordination=unickpt.CoordinationOptions(tree_min_world_size=ws + 1))
    state = {"model": model, "optimizer": optim, "extra_state": {"rank": rank}}
    out: dict[str, Any] = {}
    for name, ckpt in (("tree", tree), ("flat", flat)):
        ckpt.save(f"{base}/{name}", state, framework="fsdp2", options=unickpt.SaveOptions(files_per_rank=2))
        out[name] = _plan_summary(ckpt, "fsdp2")
    from unickpt.engine.plan_cache import PlanKey

    cached = tree.resources.plans.get(PlanKey(None, "fsdp2", 2))
    assert cached is not None
    if rank == 0:
        assert cached.coordinator is not None
        out["planner"] = type(cached.coordinator.rank_plans).__name__
        out["layout_tensors"] = sum(len(entries) for _, entries in cached.coordinator.layouts)
    tree.save(f"{base}/tree", state, framework="fsdp2", async_save=True).wait()  # cached plan, renamed
    exact = {}
    for name, ckpt, path in (("tree<-flat", tree, "flat"), ("flat<-tree", flat, "tree")):
        m2, o2 = build("fsdp2", seed=1234)
        loaded = {"model": m2, "optimizer": o2, "extra_state": None}
        ckpt.load(f"{base}/{path}", loaded, framework="fsdp2")
        got = full_state(m2, o2)
        exact[name] = (
            sorted(got) == sorted(want)
            and all(torch.equal(got[k], want[k]) for k in want)
            and loaded["extra_state"] == {"rank": rank}
        )
    out["load_exact"] = exact
    out["regular_type"] = RegularRankPlans.__name__
    for c in (tree, flat):
        c.close()
    return out


def tree_vs_flat_and_fsdp2_regular(rank: int, ws: int, ddp_base: str, fsdp2_base: str) -> list[dict[str, Any]]:
    """One 8-rank spawn for two tests: ``tree_vs_flat`` (in ``ddp_base``), then ``fsdp2_regular``
    (in ``fsdp2_base``); their two results."""
    return [tree_vs_flat(rank, ws, ddp_base), fsdp2_regular(rank, ws, fsdp2_base)]
