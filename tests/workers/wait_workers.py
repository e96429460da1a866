"""Rank functions of test_waits.py (module level, so that ``spawn`` can import them): real gloo
ranks. Each returns plain values."""

from __future__ import annotations

import datetime
import gc
import logging
import threading
from typing import Any

import torch
import torch.distributed as dist

import unickpt
from unickpt.coordination import CoordinationOptions, make_coordinator
from unickpt.coordination.torch_dist import CheckpointGroups

_WAIT = datetime.timedelta(seconds=120)


def _model() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(8, 4)}


class _Warnings(logging.Handler):
    """Keeps every warning of the ``unickpt`` logger, in order, with the errors this rank caught
    (``note``); sets store key ``warned-<case>`` at the first warning that names rank 1 as not
    arrived and mentions ``case``'s text (what the late rank waits for before it arrives)."""

    def __init__(self, store: Any, cases: dict[str, str]) -> None:
        super().__init__(logging.WARNING)
        self.store, self.cases = store, dict(cases)
        self.lines: list[str] = []
        self._mutex = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        with self._mutex:
            self.lines.append(msg)
            hit = [c for c, text in self.cases.items() if text in msg and "rank(s) [1]" in msg]
            for c in hit:
                del self.cases[c]
        for c in hit:
            self.store.set(f"warned-{c}", "1")

    def note(self, text: str) -> None:
        with self._mutex:
            self.lines.append(text)


def late_and_skipping_rank(rank: int, ws: int, base: str) -> dict[str, Any]:
    """Rank 1 arrives late at the groups' creation, at a collective and at the commit barrier,
    each time only once rank 0 has warned naming it (the saves then succeed); then it skips a
    save with a 4 s timeout. Rank 0 reports its warnings and errors in order."""
    store = dist.distributed_c10d._get_default_store().clone()  # test-only private use
    ckpt = unickpt.Checkpointer(coordination=CoordinationOptions(wait_warning_s=0.3))
    state = _model()
    cases = {
        "create": "creating unickpt's process groups",
        "collective": "all_gather_object (collective #",
        "barrier": "the commit barrier after save (write)",
    }
    log = logging.getLogger("unickpt")
    handler = _Warnings(store, cases)
    log.addHandler(handler)
    out: dict[str, Any] = {}
    try:
        if rank == 1:
            store.wait(["warned-create"], _WAIT)
        ckpt.save(f"{base}/a", state)  # rank 1 late at the first call: in the groups' creation
        if rank == 1:
            store.wait(["warned-collective"], _WAIT)
        ckpt.save(f"{base}/b", state)  # late at the first collective of a save

        def late_report(ev: Any) -> None:
            if ev.phase == "save.write" and "/c" in ev.path:
                store.wait(["warned-barrier"], _WAIT)

        if rank == 1:
            ckpt.events.add_listener(late_report)
        ckpt.save(f"{base}/c", state)  # late at the commit barrier (its write ends late)
        if rank == 1:
            ckpt.events.remove_listener(late_report)
            store.wait(["skip-done"], _WAIT)  # skips save d: stays alive until rank 0 gave up
            return {"skipped": True}
        try:
            ckpt.save(f"{base}/d", state, options=unickpt.SaveOptions(timeout=4.0))
            handler.note("NO ERROR")
        except Exception as e:
            handler.note(f"ERROR {type(e).__name__}: {e}")
        store.set("skip-done", "1")
        out["lines"] = list(handler.lines)
        return out
    finally:
        log.removeHandler(handler)


def late_skipping_then_lost_peer(rank: int, ws: int, base: str, rounds: int) -> dict[str, Any]:
    """``late_and_skipping_rank``, then ``destroyed_peer_rounds`` (fresh groups), in one spawn."""
    out = late_and_skipping_rank(rank, ws, base)
    out.update(destroyed_peer_rounds(rank, ws, base, rounds))
    return out


def destroyed_peer_rounds(rank: int, ws: int, base: str, rounds: int) -> dict[str, Any]:
    """``rounds`` times: a fresh checkpointer (its own unickpt groups); both ranks make one
    collective; rank 1 destroys its unickpt groups; rank 0 then runs each kind of call on them (a
    save too) and reports the type of each error (every one must be unickpt's ``CollectiveError``)."""
    store = dist.distributed_c10d._get_default_store().clone()  # test-only private use
    seen = [_destroyed_round(rank, i, base, store) for i in range(rounds)]
    return {"rounds": [s for s in seen if s is not None]}


def _destroyed_round(rank: int, i: int, base: str, store: Any) -> dict[str, str] | None:
    ckpt = unickpt.Checkpointer(coordination=CoordinationOptions(wait_warning_s=0))
    groups: CheckpointGroups = ckpt.resources.groups
    coord = make_coordinator(groups, None, "foreground", timeout=20.0, label=f"round {i}")
    coord.all_gather_object(rank)  # the groups exist and are connected on both ranks
    if rank == 1:
        for ch in ("foreground", "background"):
            dist.destroy_process_group(groups.channel(None, ch).group)
        # the last references go: the gloo groups close their connections now, as in a process that died
        groups._sets.clear()  # test-only private use
        del coord, groups
        gc.collect()
        store.set(f"destroyed-{i}", "1")
        store.wait([f"checked-{i}"], _WAIT)
        return None
    store.wait([f"destroyed-{i}"], _WAIT)
    buf = torch.zeros(4, dtype=torch.uint8)
    calls = {
        "all_gather_object": lambda: coord.all_gather_object(0),
        "broadcast_object": lambda: coord.broadcast_object(1),
        "barrier": coord.barrier,
        "isend": lambda: coord.isend(buf, 1, 7).wait(),
        "irecv": lambda: coord.irecv(buf, 1, 8).wait(),
        "save": lambda: ckpt.save(f"{base}/round{i}", _model(), options=unickpt.SaveOptions(timeout=20.0)),
    }
    got = {}
    for name, fn in calls.items():
        try:
            fn()
            got[name] = "no error"
        except unickpt.CollectiveError as e:
            got[name] = f"CollectiveError:{type(e).__name__}"
        except Exception as e:
            got[name] = f"RAW {type(e).__module__}.{type(e).__name__}: {e}"
    store.set(f"checked-{i}", "1")
    return got
