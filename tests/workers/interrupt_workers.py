"""Rank functions of the Ctrl-C tests (``tests/integration/engine/test_save_interrupt_processes.py``):
a blocking save interrupted by a real SIGINT sent to this rank's process at chosen phases of the
save (an event listener, i.e. synchronised with the save's own progress, never a sleep)."""

from __future__ import annotations

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


def interrupted_saves(rank: int, ws: int, root: str, cases: list[list[Any]]) -> list[dict[str, Any]]:
    """For each ``[name, {rank: [phase, ...]}, own_handler?]`` of ``cases``: commit a first save of a small
    replicated model at ``root/name``, take a training step, then save again while SIGINT is sent
    to this process at each listed phase of that second save (this rank's event). Report whether
    the call raised ``KeyboardInterrupt`` (and its message), the committed save id right when it
    returned or raised, and the first save's id. Rank 0 keeps both states in ``root/name.<first|
    second>.pt`` for the parent's bit-exact check. ``own_handler``: the process has a SIGINT
    handler of its own meanwhile, which raises ``KeyboardInterrupt`` (unickpt leaves it in place)."""
    model, optim = tiny_model(seed=5)
    state = {"model": model, "optimizer": optim}
    options = unickpt.SaveOptions(timeout=30)  # a rank left behind in a collective fails within 30 s
    events = unickpt.default_checkpointer().events
    out = []
    for i, (name, phases_by_rank, *own) in enumerate(cases):
        if own and own[0]:  # the application's own SIGINT handler (it raises KeyboardInterrupt itself)
            signal.signal(signal.SIGINT, _own_handler)
        path = os.path.join(root, name)
        unickpt.save(path, state, framework="ddp", options=options)
        first = committed_id(path)
        if rank == 0:
            torch.save(snapshot(model, optim), f"{path}.first.pt")
        step(model, optim, 100 + i)
        if rank == 0:
            torch.save(snapshot(model, optim), f"{path}.second.pt")
        todo = list(phases_by_rank.get(str(rank), []))

        def interrupt(ev: Event, todo: list[str] = todo) -> None:
            if todo and ev.phase == todo[0] and ev.rank == rank:
                todo.pop(0)
                os.kill(os.getpid(), signal.SIGINT)  # a real signal, handled on the main thread

        events.add_listener(interrupt)
        try:
            unickpt.save(path, state, framework="ddp", options=options)
            raised, message = False, ""
        except KeyboardInterrupt as e:
            raised, message = True, str(e)
        seen = committed_id(path)  # the folder's state when the call returned or raised
        events.remove_listener(interrupt)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out.append({"raised": raised, "message": message, "seen": seen, "first": first, "left": todo})
        torch.distributed.barrier()
    return out
