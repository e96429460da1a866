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
    run_ranks(save_with_and_without_phases, 2, base)
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
        assert {"save.serialize", "save.plan", "save.stage", "save.write", "save.write.file"} <= phases, phases
    # rank 0's are complete; the others' end at their report (then they wait for rank 0's commit)
    assert {"save.barrier", "save.commit", "save.finalize"} <= {row[0] for row in doc["ranks"][0]}
    written = [row for row in doc["ranks"][1] if row[0] == "save.write.file"]
    assert written and all(row[4].startswith(f"data/{sid}/r00001-") and row[3] > 0 for row in written)

    assert main(["report", on]) == 0
    out = capsys.readouterr().out
    assert f"phases of save {sid} at {on} (2 rank(s), kept in the checkpoint)" in out
    header = next(line for line in out.splitlines() if line.startswith("rank "))
    assert "save.plan" in header and "save.write" in header and "save.finalize" in header
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
