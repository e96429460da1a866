"""Monitoring (issue 16): records for every phase on every rank, bounded by the measured wall
time; the report's table, heat map, trace and SQLite; a raising listener never fails a save.

Its tests that start processes are in ``tests/integration/monitoring/test_monitoring_processes.py``."""

from __future__ import annotations

import logging

import torch
from torch import nn

import unickpt
from unickpt.monitoring import SummaryLogger
from unickpt.options import RestoreOptions

# also recorded: load.copy (copies into place, overlapped with load.read), load.transfer (forwarding)


def test_issue16_straggler_is_named():
    from unickpt.monitoring.report import Report, format_text

    recs = [
        {"phase": "save.write", "rank": r, "start_unix": 0.0, "seconds": 1.0 if r != 2 else 3.0, "bytes": 10**9}
        for r in range(4)
    ]
    rep = Report.build(recs, k=1.5)
    assert rep.stragglers == [("save.write", 2, 3.0, 1.0)]
    assert "straggler: rank 2 in save.write" in format_text(rep)


def test_issue16_raising_listener_never_fails_a_save(tmp_path, caplog):
    model = nn.Linear(3, 2)
    calls = []

    def broken(ev):
        calls.append(ev.phase)
        raise RuntimeError("listener bug")

    ckpt = unickpt.Checkpointer(listeners=[broken, SummaryLogger()])
    with caplog.at_level(logging.INFO, logger="unickpt"):
        ckpt.save(str(tmp_path / "ck"), {"model": model})
        fresh = nn.Linear(3, 2)
        ckpt.load(str(tmp_path / "ck"), {"model": fresh})
    ckpt.close()
    assert torch.equal(fresh.weight, model.weight)
    assert "save.end" in calls and ckpt.events.listener_errors == len(calls)
    text = caplog.text
    assert text.count("listener bug") == 1  # reported once
    assert "unickpt save" in text and "GB/s" in text and "blocking" in text


def test_issue16_retries_are_recorded_with_their_cause(tmp_path):
    """A storage write that fails once with EIO is retried; the retry is an event naming the
    operation, the file, the attempt and the cause, and the save succeeds."""
    import errno

    from unickpt.storage import register_storage
    from unickpt.storage.local import LocalStorage

    failed: set[str] = set()

    class FailsOnce(LocalStorage):
        def write(self, name, parts):
            if name.startswith("data/") and name not in failed:
                failed.add(name)
                raise OSError(errno.EIO, "injected I/O error")
            super().write(name, parts)

    register_storage("failsonce", FailsOnce, replace=True)
    seen = []
    ckpt = unickpt.Checkpointer(listeners=[lambda ev: seen.append(ev) if ev.phase == "storage.retry" else None])
    model = nn.Linear(3, 2)
    ckpt.save(f"failsonce://{tmp_path}/ck", {"model": model})
    ckpt.close()
    assert failed and len(seen) == len(failed)
    assert all("write attempt 1 failed" in ev.detail and "injected I/O error" in ev.detail for ev in seen)
    assert all(ev.path.startswith(str(tmp_path)) and "/data/" in ev.path for ev in seen)


def test_issue16_copies_into_place_are_a_phase(tmp_path):
    """A load that cannot read in place (fp32 checkpoint into an fp64 model, cast while copying)
    records load.copy with the bytes copied."""
    seen = []
    ckpt = unickpt.Checkpointer(listeners=[lambda ev: seen.append(ev) if ev.phase == "load.copy" else None])
    model = nn.Linear(16, 8)
    ckpt.save(str(tmp_path / "ck"), {"model": model})
    wide = nn.Linear(16, 8).to(torch.float64)
    ckpt.load(
        str(tmp_path / "ck"), {"model": wide}, options=unickpt.LoadOptions(restore=RestoreOptions(cast_dtypes=True))
    )
    ckpt.close()
    assert len(seen) == 1 and seen[0].nbytes == (16 * 8 + 8) * 4 and seen[0].seconds >= 0
    assert torch.equal(wide.weight, model.weight.double())
