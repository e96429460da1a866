"""``unickpt report``: which rank, which phase. Reads the ``JsonlSink`` files of a folder (the
phase records a checkpoint keeps of its save, ``monitoring.phases``, are read by
``ops.report``), and builds a rank x phase table, stragglers, per-rank throughput, a heat map
PNG, a Perfetto / Chrome trace and, on request, a SQLite database of every record.

Order of use: ``load_records(folder)`` or ``ops.report.checkpoint_records(path)``
(``ops.report.source_records`` picks by what ``path`` holds) -> ``Report.build(records, k)`` (pure) ->
``format_text`` / ``heatmap_png`` (matplotlib, headless Agg backend) / ``chrome_trace`` /
``to_sqlite``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, ConfigurationError

__all__ = [
    "PHASE_COLUMNS",
    "WAITING_PHASES",
    "STRAGGLER_FLOOR_S",
    "Report",
    "load_records",
    "NoPhaseRecords",
    "to_sqlite",
    "chrome_trace",
    "heatmap_png",
    "heatmap_figure",
    "heatmap_title",
    "format_text",
    "storage_lines",
]

# the duration phases of a save and a load, in pipeline order (nested file writes excluded)
PHASE_COLUMNS = (
    "save.groups",
    "save.plan",
    "save.stage",
    "save.write",
    "save.barrier",
    "save.finalize",
    "load.groups",
    "load.metadata",
    "load.plan",
    "load.read",
    "load.transfer",
    "load.apply",
)
# time a rank spends waiting for the others, not working: the creation of the process groups (a
# rendezvous: the first rank there waits for the last), the commit barrier (its report until
# every rank reported), the forwarding of a load (until other ranks' batches arrive), and the
# finalize phase of ranks other than 0 (they wait for rank 0's commit; rank 0 commits in it)
WAITING_PHASES = ("save.groups", "load.groups", "save.barrier", "load.transfer")
_WAITING_EXCEPT_RANK0 = ("save.finalize",)
# a rank is a straggler in a phase only when it lost at least this many seconds there against
# the median (besides k x the median): on a 0.09 s save, 0.04 s is noise, not a slow rank
STRAGGLER_FLOOR_S = 0.1
_MAX_LINE = 1 << 16
_FIELDS = ("phase", "rank", "start_unix", "seconds", "bytes")


def load_records(folder: str) -> list[dict[str, Any]]:
    """Every record of every ``rank*.jsonl`` file in ``folder`` (malformed lines are skipped)."""
    if not os.path.isdir(folder):
        raise ConfigurationError(f"{folder} is not a folder of unickpt metrics (rank<r>.jsonl files)")
    out: list[dict[str, Any]] = []
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("rank") and name.endswith(".jsonl")):
            continue
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
            for line in f:
                if len(line) > _MAX_LINE:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and all(k in rec for k in _FIELDS):
                    out.append(rec)
    if not out:
        raise ConfigurationError(f"{folder} holds no unickpt metrics records")
    return out


class NoPhaseRecords(CheckpointError):
    """The checkpoint keeps no phase records (saved with ``SaveOptions(record_phases=False)`` or
    by a unickpt before they were kept)."""


@dataclass
class Report:
    ranks: list[int]
    table: dict[int, dict[str, float]]  # rank -> phase -> seconds (summed over operations)
    nbytes: dict[int, int]  # rank -> bytes written + read
    stragglers: list[tuple[str, int, float, float]] = field(default_factory=list)  # phase, rank, s, median

    @classmethod
    def build(cls, records: list[dict[str, Any]], k: float = 1.5, min_seconds: float = STRAGGLER_FLOOR_S) -> Report:
        """The table of ``records``; a straggler is a rank slower than ``k`` x the median of a phase
        and by more than ``min_seconds``."""
        table: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        nbytes: dict[int, int] = defaultdict(int)
        for r in records:
            if r["phase"] in PHASE_COLUMNS:
                table[int(r["rank"])][r["phase"]] += float(r["seconds"])
                if r["phase"] in ("save.write", "load.read"):
                    nbytes[int(r["rank"])] += int(r["bytes"])
        ranks = sorted(table)
        rep = cls(ranks, {r: dict(table[r]) for r in ranks}, dict(nbytes))
        for phase in PHASE_COLUMNS:
            values = [rep.table[r].get(phase, 0.0) for r in ranks]
            if len(values) < 2:
                continue
            med = statistics.median(values)
            for rank, v in zip(ranks, values):
                if v > k * med and v - med > min_seconds:
                    rep.stragglers.append((phase, rank, v, med))
        return rep

    def own_work(self, rank: int) -> dict[str, float]:
        """``rank``'s seconds per phase without the phases it spent waiting for other ranks
        (``WAITING_PHASES``): the rank that finished its work first waits longest there."""
        return {
            p: s
            for p, s in self.table[rank].items()
            if p not in WAITING_PHASES and (rank == 0 or p not in _WAITING_EXCEPT_RANK0)
        }

    def slowest_rank(self) -> int:
        """The rank slowest in its own work (waiting phases excluded; ties: the lowest rank)."""
        return max(self.ranks, key=lambda r: (sum(self.own_work(r).values()), -r))


def format_text(rep: Report, k: float = 1.5) -> str:
    cols = [c for c in PHASE_COLUMNS if any(c in rep.table[r] for r in rep.ranks)]
    lines = ["rank  " + "  ".join(f"{c:>13s}" for c in cols) + "   total s   GB/s"]
    for r in rep.ranks:
        total = sum(rep.table[r].values())
        io = sum(rep.table[r].get(c, 0.0) for c in ("save.write", "load.read"))
        gbps = rep.nbytes.get(r, 0) / io / 1e9 if io > 0 else 0.0
        cells = "  ".join(f"{rep.table[r].get(c, 0.0):13.4f}" for c in cols)
        lines.append(f"{r:4d}  {cells}  {total:8.4f}  {gbps:5.2f}")
    slow = rep.slowest_rank()
    own = rep.own_work(slow)
    parts = ", ".join(f"{c} {s:.4f} s" for c, s in sorted(own.items(), key=lambda kv: -kv[1]))
    lines.append(f"slowest rank: {slow} in its own work, {sum(own.values()):.4f} s ({parts}; waiting excluded)")
    if rep.stragglers:
        for phase, r, v, med in rep.stragglers:
            lines.append(
                f"straggler: rank {r} in {phase}: {v:.4f} s, {v / med if med else float('inf'):.1f}x the median"
            )
    else:
        lines.append(
            f"no stragglers (no rank slower than {k}x the median and by more than {STRAGGLER_FLOOR_S} s in any phase)"
        )
    return "\n".join(lines)


def chrome_trace(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome / Perfetto trace JSON: one process row per rank, one slice per phase."""
    t0 = min(float(r["start_unix"]) for r in records)
    events: list[dict[str, Any]] = []
    for rank in sorted({int(r["rank"]) for r in records}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    for r in records:
        events.append(
            {
                "name": r["phase"],
                "ph": "X",
                "pid": int(r["rank"]),
                "tid": str(r.get("thread", "")),
                "ts": (float(r["start_unix"]) - t0) * 1e6,
                "dur": max(float(r["seconds"]), 0.0) * 1e6,
                "args": {k: r.get(k) for k in ("bytes", "path", "save_id", "step", "role")},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def heatmap_title(rep: Report, records: list[dict[str, Any]], source: str) -> str:
    """The heat map's title: where the records come from, the save id(s), the slowest rank's total."""
    ids = sorted({str(r["save_id"]) for r in records if r.get("save_id")})
    saves = f"save {ids[0]}, " if len(ids) == 1 else f"{len(ids)} saves, " if ids else ""
    if len(ids) == 1 and ids[0] in source:
        saves = ""  # the source line names it already
    total = max((sum(rep.table[r].values()) for r in rep.ranks), default=0.0)
    return f"{source}\n{saves}total {total:.3f} s (the longest rank, waiting included)"


def heatmap_png(rep: Report, out: str, title: str = "") -> None:
    """``heatmap_figure`` written to ``out`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = heatmap_figure(rep, title)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def heatmap_figure(rep: Report, title: str = "") -> Any:
    """A rank x phase heat map (a matplotlib Figure, headless Agg backend): seconds written in
    every cell, the colour scale from 0 s (a 0.05 s spread does not look like 0 against 10),
    ``title`` above it (``heatmap_title``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [c for c in PHASE_COLUMNS if any(c in rep.table[r] for r in rep.ranks)]
    data = [[rep.table[r].get(c, 0.0) for c in cols] for r in rep.ranks]
    top = max((v for row in data for v in row), default=0.0) or 1.0
    fig, ax = plt.subplots(figsize=(1.2 * len(cols) + 2.5, 0.4 * len(rep.ranks) + 2.5))
    im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0.0, vmax=top)
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.3f}", ha="center", va="center", fontsize=8, color="white" if v < top / 2 else "black")
    ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right")
    ax.set_yticks(range(len(rep.ranks)), [str(r) for r in rep.ranks])
    ax.set_xlabel("phase")
    ax.set_ylabel("rank")
    if title:
        ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="seconds")
    fig.tight_layout()
    return fig


def to_sqlite(records: list[dict[str, Any]], db: str) -> int:
    """Write every record into table ``records`` of the SQLite file ``db`` (created)."""
    cols = (
        "phase",
        "rank",
        "start_unix",
        "seconds",
        "bytes",
        "path",
        "save_id",
        "thread",
        "host",
        "pid",
        "step",
        "role",
    )
    con = sqlite3.connect(db)
    try:
        con.execute(f"CREATE TABLE IF NOT EXISTS records ({', '.join(cols)})")
        con.executemany(
            f"INSERT INTO records VALUES ({', '.join('?' for _ in cols)})",
            [tuple(r.get(c) for c in cols) for r in records],
        )
        con.commit()
    finally:
        con.close()
    return len(records)


def storage_lines(records: list[dict[str, Any]], slowest: int = 10) -> list[str]:
    """The storage-side view: per-file write / read throughput (slowest first) and every retry
    with its cause."""
    lines: list[str] = []
    for phase, what in (("save.write.file", "writes"), ("load.read.file", "reads")):
        files = [r for r in records if r["phase"] == phase and float(r["seconds"]) > 0]
        if not files:
            continue
        files.sort(key=lambda r: int(r["bytes"]) / float(r["seconds"]))
        total = sum(int(r["bytes"]) for r in files)
        lines.append(f"file {what}: {len(files)} files, {total} bytes; slowest:")
        for r in files[:slowest]:
            gbps = int(r["bytes"]) / float(r["seconds"]) / 1e9
            lines.append(f"  rank {r['rank']:>4}  {gbps:8.3f} GB/s  {int(r['bytes']):>12} B  {r.get('path', '')}")
    retries = [r for r in records if r["phase"] == "storage.retry"]
    lines.append(f"storage retries: {len(retries)}")
    for r in retries[:slowest]:
        lines.append(f"  rank {r['rank']:>4}  {r.get('path', '')}: {r.get('detail', '')}")
    return lines
