"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/monitoring/test_phases.py``, which holds its single-process tests."""

from __future__ import annotations

import json
import os

from tests.unit.monitoring.test_phases import _save_id
from tests.workers.harness import run_ranks
from tests.workers.monitor_workers import save_with_and_without_phases
from unickpt.cli import main


def _rows(text: str, ranks: range) -> dict[int, list[str]]:
    """The report table's row of each rank: its cells."""
    out = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0].isdigit() and int(cells[0]) in ranks and len(cells) > 3:
            out[int(cells[0])] = cells
    return out


def test_issue26_item14_two_ranks_save_keeps_phases_and_report_shows_both(tmp_path, capsys):
    base = str(tmp_path)
    loads = run_ranks(save_with_and_without_phases, 2, base)
    on, off = f"{base}/on", f"{base}/off"
    sid = _save_id(on)
    kept = os.path.join(on, "data", sid, "phases.json")
    with open(kept, "rb") as f:
        data = f.read()
    assert len(data) < 8 * 1024  # a few KB for two ranks
    doc = json.loads(data)
    assert (doc["format"], doc["version"], doc["save_id"], doc["world_size"]) == ("unickpt.phases", 1, sid, 2)
    for rank in (0, 1):
        phases = {row[0] for row in doc["ranks"][rank]}
        assert {"save.groups", "save.serialize", "save.plan", "save.stage", "save.write"} <= phases, phases
        assert "save.write.file" in phases
        # the first save of the process created the process groups: that time is its first record
        first = doc["ranks"][rank][0]
        assert first[0] == "save.groups" and first[2] > 0, first
    # rank 0's are complete; the others' end at their report (then they wait for rank 0's commit)
    assert {"save.barrier", "save.commit", "save.finalize"} <= {row[0] for row in doc["ranks"][0]}
    written = [row for row in doc["ranks"][1] if row[0] == "save.write.file"]
    assert written and all(row[4].startswith(f"data/{sid}/r00001-") and row[3] > 0 for row in written)

    # issue #30: a cold load's group creation is a load phase, between load.begin and the rest
    for events in loads:
        names = [p for p, _, _ in events]
        assert names[:2] == ["load.begin", "load.groups"] and names[-1] == "load.end", names
        begin, (_, g0, g1), end = events[0], events[1], events[-1]
        assert begin[1] == g0 == end[1] and g1 > g0, events  # created here: it took time; load.end spans it
        assert all(t0 >= g1 for p, t0, _ in events[2:-1]), events  # every other phase follows it

    assert main(["report", on]) == 0
    out = capsys.readouterr().out
    assert f"phases of save {sid} at {on} (2 rank(s), kept in the checkpoint)" in out
    header = next(line for line in out.splitlines() if line.startswith("rank "))
    assert "save.plan" in header and "save.write" in header and "save.finalize" in header
    assert "save.groups" in header
    rows = _rows(out, range(2))
    assert sorted(rows) == [0, 1]
    assert "slowest rank:" in out and f"data/{sid}/r00001-0" in out  # per-file writes of rank 1
    assert main(["verify", on]) == 0  # the extra file is no problem for verify
    capsys.readouterr()

    # the option off: no file, and the report says so
    sid_off = _save_id(off)
    names = os.listdir(os.path.join(off, "data", sid_off))
    assert names and all(n.startswith("r0000") and n.endswith(".bin") for n in names), names
    assert main(["report", off]) == 1
    out = capsys.readouterr().out
    assert f"{off}: no phase records in this checkpoint (save {sid_off})" in out
