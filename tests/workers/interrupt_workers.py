"""Rank functions of the Ctrl-C tests (``tests/integration/engine/test_save_interrupt_processes.py``):
a blocking save interrupted by a real SIGINT sent to this rank's process at chosen phases of the
save (an event listener, i.e. synchronised with the save's own progress, never a sleep)."""

from __future__ import annotations

import errno
import json
import os
import signal
from typing import Any

import torch

import unickpt
from tests.workers.rel_helpers import snapshot, step, tiny_model
from unickpt.format.records import METADATA_FILE
from unickpt.monitoring.events import Event


def committed_id(path: str) -> str | None:
    """The save id of the checkpoint committed at ``path`` (None: none)."""
    try:
        with open(os.path.join(path, METADATA_FILE), "rb") as f:
            return str(json.loads(f.read())["save_id"])
    except FileNotFoundError:
        return None


def _own_handler(signum: int, frame: object) -> None:
    raise KeyboardInterrupt("the application's handler")


def interrupted_saves(rank: int, ws: int, root: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each case (``name``; ``signals``: {rank: [phase, ...]}; ``own_handler``; ``fail_rank``):
    commit a first save of a small replicated model at ``root/name``, take a training step, then
    save again while SIGINT is sent to this process at each listed phase of that second save (this
    rank's event). Report whether the call raised ``KeyboardInterrupt`` (its message) or another
    error, the committed save id right when it returned or raised, and the first save's id. Rank 0
    keeps both states in ``root/name.<first|second>.pt`` for the parent's bit-exact check.
    ``own_handler``: the process has a SIGINT handler of its own meanwhile, which raises
    ``KeyboardInterrupt`` (unickpt leaves it in place); ``fail_rank``: that rank's data file writes
    of the second save fail with ENOSPC (``faulty://``), so the save fails on every rank."""
    from tests.workers.rel_faults import install_faulty_scheme

    # Python's own SIGINT handler, as in any interactive run: a process started with SIGINT ignored
    # (a background job of a non-interactive shell inherits SIG_IGN, and Python then installs no
    # handler) would ignore the test's signals (the deferral needs default_int_handler: its docstring)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    model, optim = tiny_model(seed=5)
    state = {"model": model, "optimizer": optim}
    options = unickpt.SaveOptions(timeout=30)  # a rank left behind in a collective fails within 30 s
    events = unickpt.default_checkpointer().events
    out = []
    for i, case in enumerate(cases):
        path = os.path.join(root, case["name"])
        target = path if case["fail_rank"] is None else f"faulty://{path}"
        install_faulty_scheme(fail_op="write", fail_times=0)
        unickpt.save(target, state, framework="ddp", options=options)
        first = committed_id(path)
        if rank == 0:
            torch.save(snapshot(model, optim), f"{path}.first.pt")
        step(model, optim, 100 + i)
        if rank == 0:
            torch.save(snapshot(model, optim), f"{path}.second.pt")
        failing = 1000 if case["fail_rank"] == rank else 0
        install_faulty_scheme(fail_op="write", fail_times=failing, errno_code=errno.ENOSPC, match="/data/")
        todo = list(case["signals"].get(str(rank), []))

        at_kill: list[str] = []  # the SIGINT handler each signal met (in the failure message, if any)

        def interrupt(ev: Event, todo: list[str] = todo, at_kill: list[str] = at_kill) -> None:
            if todo and ev.phase == todo[0] and ev.rank == rank:
                todo.pop(0)
                at_kill.append(f"{ev.phase}: {signal.getsignal(signal.SIGINT)!r}")
                os.kill(os.getpid(), signal.SIGINT)  # a real signal, handled on the main thread

        if case["own_handler"]:
            signal.signal(signal.SIGINT, _own_handler)
        events.add_listener(interrupt)
        cause = ""
        try:
            unickpt.save(target, state, framework="ddp", options=options)
            raised = "nothing"
            message = ""
        except KeyboardInterrupt as e:
            raised, message = "KeyboardInterrupt", str(e)
            cause = type(e.__cause__).__name__ if e.__cause__ is not None else ""
        except unickpt.CheckpointError as e:
            raised, message = "CheckpointError", str(e)
        seen = committed_id(path)  # the folder's state when the call returned or raised
        events.remove_listener(interrupt)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out.append(
            {"raised": raised, "message": message, "cause": cause, "seen": seen, "first": first, "left": todo}
            | {"handler_at_kill": at_kill}
        )
        torch.distributed.barrier()
    return out
