"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/monitoring/test_monitoring.py``, which holds its single-process tests."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

from tests.workers.harness import run_ranks
from tests.workers.monitor_workers import save_and_load_recorded

SAVE = ("save.plan", "save.stage", "save.write", "save.barrier", "save.finalize")
LOAD = ("load.metadata", "load.plan", "load.read", "load.apply")


def test_issue16_four_ranks_record_every_phase_within_the_wall_time(tmp_path):
    folder = str(tmp_path / "metrics")
    walls = run_ranks(save_and_load_recorded, 4, str(tmp_path / "ck"), folder)
    assert sorted(os.listdir(folder)) == [f"rank{r}.jsonl" for r in range(4)]
    for r in range(4):
        recs = [json.loads(line) for line in open(os.path.join(folder, f"rank{r}.jsonl"))]
        by_phase = {}
        for rec in recs:
            assert rec["rank"] == r and rec["seconds"] >= 0
            by_phase.setdefault(rec["phase"], []).append(rec)
        for phase in SAVE + LOAD:
            assert phase in by_phase, (r, phase, sorted(by_phase))
            assert all(x["seconds"] > 0 for x in by_phase[phase]), (r, phase)
        assert sum(by_phase[p][0]["seconds"] for p in SAVE) <= walls[r]["save"]
        assert sum(by_phase[p][0]["seconds"] for p in LOAD) <= walls[r]["load"]
        files = [x for x in recs if x["phase"] == "load.read.file"]  # per-file read throughput
        assert files and all(x["bytes"] > 0 and x["seconds"] > 0 and x["path"].startswith("data/") for x in files)
        copy = [x for x in recs if x["phase"] == "load.copy"]
        # whole shards land in the live tensors themselves (no copy); any copy is inside load.read
        assert len(copy) <= 1 and all(0 < c["seconds"] <= by_phase["load.read"][0]["seconds"] for c in copy)
        written = [x for x in recs if x["phase"] == "save.write.file"]
        assert written and all(x["bytes"] > 0 for x in written)
        saves = [x for x in recs if x["phase"].startswith("save.")]
        assert all(x["step"] == 42 and x["role"] == "actor" for x in saves)
    out = subprocess.run(
        [sys.executable, "-m", "unickpt.cli", "report", folder, "--png", str(tmp_path / "h.png"),
         "--trace", str(tmp_path / "t.json"), "--sqlite", str(tmp_path / "m.db")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "slowest rank:" in out.stdout and "save.write" in out.stdout
    assert "file writes:" in out.stdout and "file reads:" in out.stdout and "storage retries: 0" in out.stdout
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((tmp_path / "t.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1, 2, 3} and all(e["dur"] >= 0 for e in slices)
    con = sqlite3.connect(str(tmp_path / "m.db"))
    assert con.execute("select count(distinct rank) from records").fetchone()[0] == 4
    con.close()
