"""Functions run inside spawned child processes by the reliability tests (module level, so that
``spawn`` can import them). Each returns a small summary in plain values (the launcher sends it
in unickpt's safe value encoding); crash workers never return on the victim rank (it SIGKILLs
itself at the injected point)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import unickpt
from tests.support.reference import full_state
from tests.workers.rel_helpers import kill_at_phase, kill_in_commit, tiny_model
from unickpt.testing.toy import build, train_step


def toy_state(model: Any, optim: Any, step_no: int) -> dict[str, Any]:
    return {"model": model, "optimizer": optim, "extra_state": {"step": step_no}}


def crash_worker(
    rank: int, ws: int, root: str, same: str, fault: str, victim: int, same_path: bool, snap_file: str
) -> str:
    """Commit step 1 (and ``same``), then crash ``victim`` at ``fault`` in the next save, which
    goes to step 2 of the manager or, with ``same_path``, over ``same``."""
    model, optim = build("fsdp2", seed=0)
    train_step(model, optim, 0)
    manager = unickpt.CheckpointManager(root, keep_last=3)
    manager.save(1, toy_state(model, optim, 1), framework="fsdp2")
    unickpt.save(same, toy_state(model, optim, 1), framework="fsdp2")
    snap = full_state(model, optim)
    if rank == 0:
        torch.save(snap, snap_file)
    dist.barrier()
    train_step(model, optim, 1)  # the state saved next differs from the committed one
    if fault.startswith("commit."):
        if rank == victim:
            kill_in_commit(fault.split(".", 1)[1])
    else:
        kill_at_phase(fault, victim)
    if same_path:
        unickpt.save(same, toy_state(model, optim, 2), framework="fsdp2", async_save=True).wait()
    else:
        manager.save(2, toy_state(model, optim, 2), framework="fsdp2", async_save=True).wait()
    return "survived"


def faulty_save_worker(
    rank: int, ws: int, path: str, fail_rank: int, errno_code: int, times: int, ref_file: str
) -> dict[str, Any]:
    """Save a tiny replicated state to ``faulty://path`` whose writes on ``fail_rank`` fail
    ``times`` times with ``errno_code``; report what every rank saw."""
    from tests.workers.rel_faults import install_faulty_scheme

    model, optim = tiny_model(seed=3)
    if rank == 0:
        torch.save(full_state(model, optim), ref_file)
    counters = install_faulty_scheme(
        fail_op="write", fail_times=times if rank == fail_rank else 0, errno_code=errno_code, match="/data/"
    )
    try:
        unickpt.save(f"faulty://{path}", {"model": model, "optimizer": optim}, framework="ddp" if ws > 1 else "torch")
        return {"ok": True, "calls": dict(counters)}
    except unickpt.CheckpointError as e:
        return {"ok": False, "type": type(e).__name__, "msg": str(e), "calls": dict(counters)}


def corrupt_load_worker(rank: int, ws: int, ckpts: list[str]) -> list[dict[str, Any]]:
    """Load each of ``ckpts`` with fsdp2 on ``ws`` ranks; report the error each load raised."""
    out = []
    for ckpt in ckpts:
        model, optim = build("fsdp2", seed=99)
        try:
            unickpt.load(ckpt, {"model": model, "optimizer": optim}, framework="fsdp2")
            out.append({"ok": True})
        except unickpt.CheckpointError as e:
            out.append({"ok": False, "type": type(e).__name__, "msg": str(e)})
        except BaseException as e:
            out.append({"ok": False, "type": f"NOT A CheckpointError: {type(e).__name__}", "msg": str(e)})
            break  # the ranks may no longer agree on where they are
    return out


def fsdp2_save_worker(rank: int, ws: int, ckpt: str) -> None:
    model, optim = build("fsdp2", seed=0)
    train_step(model, optim, 0)
    unickpt.save(ckpt, {"model": model, "optimizer": optim}, framework="fsdp2")


def locked_save_worker(rank: int, ws: int, ckpt: str) -> dict[str, Any]:
    """Try to save where another live job holds the save lock: every rank must refuse."""
    model, optim = tiny_model(seed=rank)
    try:
        unickpt.save(ckpt, {"model": model, "optimizer": optim}, framework="torch" if ws == 1 else "ddp")
        return {"type": None}
    except unickpt.CheckpointError as e:
        return {"type": type(e).__name__, "msg": str(e)}


def racing_saver(
    rank: int, ws: int, ckpt: str, seed: int, barrier_dir: str, hold_s: float, ref_file: str
) -> dict[str, Any]:
    """One of two independent jobs saving to ``ckpt`` at once (both start at a file barrier);
    the commit is held for ``hold_s`` so the two saves overlap."""
    import unickpt

    model, optim = tiny_model(seed=seed)
    torch.save(full_state(model, optim), ref_file)
    unickpt.default_checkpointer().events.add_listener(
        lambda ev: time.sleep(hold_s) if ev.phase == "save.commit.begin" else None
    )
    open(os.path.join(barrier_dir, f"ready-{seed}"), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(barrier_dir)) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    t0 = time.monotonic()
    try:
        md = unickpt.save(ckpt, {"model": model, "optimizer": optim}, framework="torch").wait()
        return {"seed": seed, "ok": True, "save_id": md.save_id if md else None, "seconds": time.monotonic() - t0}
    except unickpt.CheckpointError as e:
        return {"seed": seed, "ok": False, "type": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0}


def version_state(version: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A state whose every tensor is a function of ``version`` (for the load-while-save test)."""
    model, optim = tiny_model(seed=0, width=64)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 0.001 + version + i)
    for st in optim.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                v.fill_(float(version))
    return model, optim


def repeated_saver(rank: int, ws: int, ckpt: str, versions: int, stop_file: str) -> int:
    """Save ``versions`` versions over ``ckpt`` once the loader is running, then drop ``stop_file``."""
    model, optim = version_state(0)
    deadline = time.monotonic() + 120
    while not os.path.exists(stop_file + ".loader-ready") and time.monotonic() < deadline:
        time.sleep(0.01)
    for v in range(1, versions + 1):
        new_model, new_optim = version_state(v)
        model.load_state_dict(new_model.state_dict())
        optim.load_state_dict(new_optim.state_dict())
        unickpt.save(
            ckpt,
            {"model": model, "optimizer": optim, "extra_state": {"version": v}},
            framework="torch",
            async_save=(v % 2 == 0),
        ).wait()
    open(stop_file, "w").close()
    return versions


def looping_loader(rank: int, ws: int, ckpt: str, stop_file: str) -> dict[str, Any]:
    """Load ``ckpt`` in a loop until the saver is done; check every load against its version."""
    model, optim = version_state(0)
    refs: dict[int, dict[str, torch.Tensor]] = {}
    loads, bad, errors = 0, [], []
    while not os.path.exists(stop_file) or loads == 0:
        state: dict[str, Any] = {"model": model, "optimizer": optim, "extra_state": None}
        try:
            unickpt.load(ckpt, state, framework="torch")
        except unickpt.CheckpointError as e:
            errors.append(f"{type(e).__name__}: {e}")
            continue
        v = state["extra_state"]["version"]
        if loads == 0:
            open(stop_file + ".loader-ready", "w").close()
        if v not in refs:
            refs[v] = full_state(*version_state(v))
        got = full_state(model, optim)
        if any(not torch.equal(got[k], refs[v][k]) for k in refs[v]) or set(got) != set(refs[v]):
            bad.append(v)
        loads += 1
    return {"loads": loads, "versions": sorted(refs), "bad": bad, "errors": errors}


def logged_crash_worker(rank: int, ws: int, log_prefix: str, perturb: int, *args: Any) -> str:
    """``crash_worker`` with this rank's stderr (fd 2: Python's, torch's and glibc's fatal
    messages) in ``<log_prefix>.<rank>.err`` and glibc's malloc perturbation on (``perturb``:
    the byte freed and new chunks are filled with, 0: off), so that a heap corruption shows in
    the log of the rank it happened in (issue 39 item 27)."""
    import ctypes

    fd = os.open(f"{log_prefix}.{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ["LIBC_FATAL_STDERR_"] = "1"  # glibc's fatal messages to stderr, never to a tty
    if perturb:
        ctypes.CDLL(None).mallopt(-6, perturb)  # M_PERTURB
    return crash_worker(rank, ws, *args)
