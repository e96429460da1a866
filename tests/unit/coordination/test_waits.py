"""A rank waiting in one of unickpt's collectives warns, every ``wait_warning_s``, naming the
ranks that have not arrived, and still fails at the deadline; every torch.distributed failure in
unickpt's collectives is a ``CollectiveError`` (issue 26, item 12).

Its tests that start processes are in ``tests/integration/coordination/test_waits_processes.py``."""

from __future__ import annotations

import logging
import threading

import pytest

from unickpt.coordination import CoordinationOptions
from unickpt.coordination.topology import DEFAULT_WAIT_WARNING_S, WAIT_WARNING_ENV
from unickpt.coordination.waits import Waits


def test_issue26_item12_warning_interval_option_and_environment(monkeypatch):
    monkeypatch.delenv(WAIT_WARNING_ENV, raising=False)
    assert CoordinationOptions().wait_warning_interval() == DEFAULT_WAIT_WARNING_S == 60.0
    monkeypatch.setenv(WAIT_WARNING_ENV, "2.5")
    assert CoordinationOptions().wait_warning_interval() == 2.5
    assert CoordinationOptions(wait_warning_s=7).wait_warning_interval() == 7.0  # the field wins
    assert CoordinationOptions(wait_warning_s=0).wait_warning_interval() is None  # 0: no warnings
    monkeypatch.setenv(WAIT_WARNING_ENV, "soon")
    with pytest.raises(ValueError, match=WAIT_WARNING_ENV):
        CoordinationOptions().wait_warning_interval()
    for bad in (-1, float("nan"), True, "5"):
        with pytest.raises(ValueError, match="wait_warning_s"):
            CoordinationOptions(wait_warning_s=bad)


def test_issue26_item12_a_watched_wait_warns_until_it_is_done():
    log = logging.getLogger("test.waits")
    log.propagate = False
    seen: list[str] = []
    third = threading.Event()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())
            if len(seen) == 3:
                third.set()

    handler = Keep()
    log.addHandler(handler)
    try:
        waits = Waits(log)
        ticket = waits.watch("save of /x: barrier (collective #4)", 0.01, 30.0, lambda: [2, 5], rank=1)
        assert third.wait(60)
        waits.done(ticket)
        n = len(seen)
        # a wait that ends before its first warning is never reported
        quiet = waits.watch("load of /y: gather", 3600.0, 30.0, lambda: [0])
        waits.done(quiet)
    finally:
        log.removeHandler(handler)
    assert n >= 3 and all("rank 1: save of /x: barrier (collective #4): still waiting after" in m for m in seen)
    assert all("rank(s) [2, 5] have not arrived yet" in m and "of at most 30s" in m for m in seen)
    assert not any("load of /y" in m for m in seen)


def test_issue26_item12_barrier_warning_names_missing_reports_from_low_ranks_only():
    """Ranks below NAMING_RANKS name the ranks whose report is missing; the others count them
    (one store request, not the whole reports), at any world size."""
    from unickpt.coordination.barrier import _FRAME, _StoreBarrier
    from unickpt.coordination.store import MemoryStore, StoreScope
    from unickpt.coordination.waits import NAMING_RANKS

    store = MemoryStore()
    scope = StoreScope(store, "p", 30.0, "save of /x", 60.0)
    ws = NAMING_RANKS + 4
    barriers = {r: _StoreBarrier(scope, "k", r, ws, "save (write)") for r in (0, 3, NAMING_RANKS, ws - 1)}
    for r in (3, ws - 1):  # two ranks reported
        barriers[r]._report(_FRAME.pack(r, 1, 0))
    late = [r for r in range(ws) if r not in (3, ws - 1)]
    for r in (0, 3):
        assert (
            barriers[r]._waiting_for(barriers[r].k_all)
            == f"rank(s) {late} have not reported the end of save (write) yet"
        )
    for r in (NAMING_RANKS, ws - 1):
        text = barriers[r]._waiting_for(barriers[r].k_decision)
        assert text.startswith(
            f"{ws - 2} rank(s) have not reported the end of save (write) yet (the warnings of ranks 0 to"
        )
    for r in range(ws):
        if r not in (3, ws - 1):
            barriers[0]._report(_FRAME.pack(r, 1, 0))
    b = barriers[NAMING_RANKS]
    assert b._waiting_for(b.k_decision).endswith("waiting for rank 0 to decide the commit")
    assert b._waiting_for(b.k_outcome).endswith("waiting for rank 0 to finish the commit")
