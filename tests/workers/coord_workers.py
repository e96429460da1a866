"""Functions run on spawned gloo ranks by test_coordination.py (module level, so that ``spawn``
can import them). Each returns a small summary of what its rank saw, in plain values."""

from __future__ import annotations

import datetime
import errno
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import unickpt


def _model(seed: int = 0, width: int = 16) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _framework(ws: int) -> str:
    return "ddp" if ws > 1 else "torch"


def _outcome(fn: Any) -> dict[str, Any]:
    """Run ``fn``; report the error type (and message, attributes) it raised, if any."""
    try:
        fn()
        return {"type": None}
    except unickpt.CheckpointError as e:
        return {"type": type(e).__name__, "msg": str(e), "checkpoint_error": True}
    except BaseException as e:
        return {"type": type(e).__name__, "msg": str(e), "checkpoint_error": False}


def _folder_files(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


# ----------------------------------------------------------------------------- item 5


def disagreeing_ranks(rank: int, ws: int, base: str) -> dict[str, Any]:
    """Save and load with per-rank paths, frameworks and roles: every rank must refuse, nothing
    may be written; then a save and a load with agreeing arguments still work (same groups)."""
    model, optim = _model(seed=1)
    state = {"model": model, "optimizer": optim, "extra_state": {"rank": rank}}
    out: dict[str, Any] = {}
    stamp = f"{base}/ckpt-{1000 + rank}"  # a per-rank "timestamp" in the path
    out["path"] = _outcome(lambda: unickpt.save(stamp, state, framework="ddp"))
    out["written"] = {r: _folder_files(f"{base}/ckpt-{1000 + r}") for r in range(ws)}
    fw = "ddp" if rank != ws - 1 else "torch"
    out["framework"] = _outcome(lambda: unickpt.save(f"{base}/same", state, framework=fw))
    role = None if rank == 0 else "actor"
    out["role"] = _outcome(lambda: unickpt.save(f"{base}/same", state, framework="ddp", role=role))
    out["written_same"] = _folder_files(f"{base}/same")
    unickpt.save(f"{base}/good", state, framework="ddp")
    out["load_path"] = _outcome(lambda: unickpt.load(f"{base}/good" if rank == 0 else stamp, state, framework="ddp"))
    fresh, fresh_opt = _model(seed=7)
    unickpt.load(f"{base}/good", {"model": fresh, "optimizer": fresh_opt}, framework="ddp")
    out["exact"] = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    return out


# ----------------------------------------------------------------------------- item 6


def skipping_rank(
    rank: int, ws: int, base: str, op: str, skipper: int, warm: bool, timeout: float | None = None
) -> dict[str, Any]:
    """Every rank but ``skipper`` calls ``op`` (save/load); ``warm``: after one save all ranks
    made together (unickpt's groups exist), else as the job's first unickpt call; ``timeout``:
    the call's ``SaveOptions``/``LoadOptions.timeout``. The skipper waits (on the job's store)
    until the others are done, then leaves."""
    from torch.distributed.distributed_c10d import _get_default_store  # test-only private use

    model, optim = _model(seed=2)
    state = {"model": model, "optimizer": optim}
    if warm:  # a generous deadline: ranks of a loaded test host start seconds apart
        unickpt.save(f"{base}/warm", state, framework="ddp", options=unickpt.SaveOptions(timeout=120))
    store = _get_default_store()
    others = [r for r in range(ws) if r != skipper]
    if rank == skipper:
        store.wait([f"test-done-{r}" for r in others], datetime.timedelta(seconds=120))
        return {"skipped": True}
    store.set(f"test-ready-{rank}", "1")  # the ranks that do call op enter it together
    store.wait([f"test-ready-{r}" for r in others], datetime.timedelta(seconds=120))
    t0 = time.monotonic()
    if op == "save":
        opts = unickpt.SaveOptions(timeout=timeout)
        res = _outcome(lambda: unickpt.save(f"{base}/ckpt", state, framework="ddp", options=opts))
    else:
        lopts = unickpt.LoadOptions(timeout=timeout)
        res = _outcome(lambda: unickpt.load(f"{base}/ready", state, framework="ddp", options=lopts))
    res["seconds"] = time.monotonic() - t0
    store.set(f"test-done-{rank}", "1")
    return res


# ----------------------------------------------------------------------------- item 12


class TwoArgError(Exception):
    """An exception that pickles but cannot be rebuilt from its args (not transportable)."""

    def __init__(self, a: str, b: int) -> None:
        super().__init__(f"{a}:{b}")


class _Loader:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def state_dict(self) -> dict[str, Any]:
        raise self.exc

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def same_faults(rank: int, ws: int, base: str) -> dict[str, Any]:
    """The same faults at any world size: the error type each rank sees."""
    fw = _framework(ws)
    model, optim = _model(seed=3)
    out: dict[str, Any] = {}
    bad_extra = {"model": model, "optimizer": optim, "extra_state": {"fn": print}}
    out["unencodable"] = _outcome(lambda: unickpt.save(f"{base}/unencodable", bad_extra, framework=fw))
    unickpt.save(f"{base}/ok", {"model": model, "optimizer": optim}, framework=fw)
    if ws > 1:
        dist.barrier()
    if rank == 0:
        from unickpt.format import decode_metadata

        md = decode_metadata(open(f"{base}/ok/unickpt.metadata.json", "rb").read())
        os.unlink(f"{base}/ok/{md.files[-1]}")
    if ws > 1:
        dist.barrier()
    m2, o2 = _model(seed=4)
    out["missing"] = _outcome(lambda: unickpt.load(f"{base}/ok", {"model": m2, "optimizer": o2}, framework=fw))
    unickpt.save(f"{base}/ok2", {"model": model}, framework=fw)
    wide, _ = _model(seed=5, width=24)
    out["shape"] = _outcome(lambda: unickpt.load(f"{base}/ok2", {"model": wide}, framework=fw))
    # different exception types on different ranks (or a non-CheckpointError): RankFailures
    exc: BaseException = OSError(errno.EACCES, "injected: permission denied", f"{base}/loader")
    if rank == 1:
        exc = TwoArgError("odd", 7)
    state = {"model": model, "dataloader": _Loader(exc)}
    try:
        unickpt.save(f"{base}/loader", state, framework=fw)
        out["mixed"] = {"type": None}
    except unickpt.RankFailures as e:
        out["mixed"] = {
            "type": "RankFailures",
            "ranks": sorted(e.failures),
            "types": {r: type(x).__name__ for r, x in e.failures.items()},
            "errno0": getattr(e.failures[0], "errno", None),
            "filename0": getattr(e.failures[0], "filename", None),
            "messages": dict(e.messages),
            "remote1": getattr(e.failures.get(1), "type_name", None),
            "remote1_tb": getattr(e.failures.get(1), "traceback_text", ""),
        }
    except BaseException as e:
        out["mixed"] = {"type": type(e).__name__, "msg": str(e)}
    return out


# ----------------------------------------------------------------------------- issue 10 item 4


def staggered_async_failure(rank: int, ws: int, base: str) -> dict[str, Any]:
    """An async save fails on every rank, but rank 1's worker finishes that failed save only
    once rank 0 has already entered its next save (rank 1's cleanup waits for it). Every rank
    must still report that failure exactly once, and nobody may hang."""
    from torch.distributed.distributed_c10d import _get_default_store  # test-only private use

    from unickpt.errors import StorageError
    from unickpt.format.records import METADATA_FILE
    from unickpt.storage import register_storage
    from unickpt.storage.local import LocalStorage

    store = _get_default_store()
    gate = {"hit": False}

    class FailingWrites(LocalStorage):
        def write(self, name: str, parts: Any) -> None:
            raise StorageError(errno.EACCES, f"injected: cannot write {name}")

        def read(self, name: str, *args: Any, **kwargs: Any) -> bytes | None:
            if rank == 1 and name == METADATA_FILE and not gate["hit"]:
                gate["hit"] = True  # the failed save's cleanup on rank 1: wait for rank 0
                store.wait(["rank0-in-next-save"], datetime.timedelta(seconds=60))
            return super().read(name, *args, **kwargs)

    register_storage("failwrites", FailingWrites, replace=True)
    if rank == 0:
        unickpt.default_checkpointer().events.add_listener(
            lambda ev: store.set("rank0-in-next-save", "1") if ev.phase == "save.begin" else None
        )
    model, optim = _model(seed=6)
    state = {"model": model, "optimizer": optim}
    first = unickpt.save(f"failwrites://{base}/first", state, framework="ddp", async_save=True)
    if rank == 0:
        deadline = time.monotonic() + 60
        while not first.done() and time.monotonic() < deadline:
            time.sleep(0.01)
    seen = []
    for call in ("save", "wait_all"):
        try:
            if call == "save":
                unickpt.save(f"{base}/second", state, framework="ddp")
            else:
                unickpt.wait_all()
        except unickpt.CheckpointError as e:
            paths = [p for p, _ in e.failures] if isinstance(e, unickpt.AsyncSaveFailures) else []
            seen.append({"call": call, "type": type(e).__name__, "paths": paths})
    return {"seen": seen, "gate_hit": gate["hit"]}
