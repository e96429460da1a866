"""``unickpt report``'s headline names the rank slowest in its own work, not the rank that
waited longest for the others (issue 26, item 13). Synthetic phase records, one process."""

from __future__ import annotations

from unickpt.monitoring.report import Report, format_text


def _rec(phase: str, rank: int, seconds: float) -> dict:
    return {"phase": phase, "rank": rank, "start_unix": 0.0, "seconds": seconds, "bytes": 0}


def test_issue26_item13_slowest_rank_excludes_waiting_phases():
    # rank 2 writes for 4 s; ranks 0 and 1 finish in 1 s and then wait 3+ s in the barrier, and
    # rank 1 also waits for rank 0's commit (its save.finalize): their totals are the longest
    records = [
        _rec("save.plan", 0, 0.2), _rec("save.write", 0, 1.0), _rec("save.barrier", 0, 3.5),
        _rec("save.finalize", 0, 0.3),
        _rec("save.plan", 1, 0.2), _rec("save.write", 1, 1.0), _rec("save.barrier", 1, 3.4),
        _rec("save.finalize", 1, 2.0),
        _rec("save.plan", 2, 0.2), _rec("save.write", 2, 4.0), _rec("save.barrier", 2, 0.01),
        _rec("save.finalize", 2, 0.3),
    ]  # fmt: skip
    rep = Report.build(records)
    totals = {r: sum(rep.table[r].values()) for r in rep.ranks}
    assert totals[2] < totals[0] and totals[2] < totals[1]  # the waiting ranks have the longest totals
    assert rep.slowest_rank() == 2
    text = format_text(rep)
    headline = [line for line in text.splitlines() if line.startswith("slowest rank:")]
    # its save.finalize is waiting for rank 0's commit: excluded too
    assert headline == [
        "slowest rank: 2 in its own work, 4.2000 s (save.write 4.0000 s, save.plan 0.2000 s; waiting excluded)"
    ]
    # the straggler line agrees: rank 2 in its write
    assert "straggler: rank 2 in save.write" in text


def test_issue26_item13_rank0_commit_counts_as_its_own_work():
    # rank 0 commits in save.finalize (its own work); rank 1 only waits for it there
    records = [
        _rec("save.write", 0, 1.0), _rec("save.finalize", 0, 2.0),
        _rec("save.write", 1, 1.5), _rec("save.finalize", 1, 2.1), _rec("load.transfer", 1, 9.0),
    ]  # fmt: skip
    rep = Report.build(records)
    assert rep.slowest_rank() == 0
    assert rep.own_work(1) == {"save.write": 1.5}


def test_issue30_group_creation_is_a_column_and_waiting():
    # rank 0 reached the groups' rendezvous first and waited 2 s there for rank 1, which then
    # read longer: the table shows the groups phase, the headline names rank 1
    records = [
        _rec("load.groups", 0, 2.0), _rec("load.read", 0, 1.0),
        _rec("load.groups", 1, 0.01), _rec("load.read", 1, 1.5),
        _rec("save.groups", 0, 0.5), _rec("save.groups", 1, 0.01),
    ]  # fmt: skip
    rep = Report.build(records)
    assert rep.table[0] == {"load.groups": 2.0, "load.read": 1.0, "save.groups": 0.5}
    assert rep.slowest_rank() == 1
    assert rep.own_work(0) == {"load.read": 1.0}
    header = next(line for line in format_text(rep).splitlines() if line.startswith("rank "))
    assert "save.groups" in header and "load.groups" in header


def test_issue39_item21_no_straggler_below_the_absolute_floor():
    # a 0.09 s save where one rank took 0.04 s longer in its write: 3x the median, but noise
    records = [
        _rec("save.plan", 0, 0.01), _rec("save.write", 0, 0.02), _rec("save.finalize", 0, 0.01),
        _rec("save.plan", 1, 0.01), _rec("save.write", 1, 0.02), _rec("save.finalize", 1, 0.01),
        _rec("save.plan", 2, 0.01), _rec("save.write", 2, 0.06), _rec("save.finalize", 2, 0.01),
    ]  # fmt: skip
    rep = Report.build(records)
    assert rep.stragglers == []
    assert "no stragglers" in format_text(rep)
    # the same shape at seconds, not hundredths of a second, is a straggler
    slow = Report.build([{**r, "seconds": r["seconds"] * 100} for r in records])
    assert [(p, r) for p, r, _, _ in slow.stragglers] == [("save.write", 2)]


def test_issue39_item21_heat_map_has_title_values_and_a_scale_from_zero(tmp_path):
    from unickpt.monitoring.report import heatmap_figure, heatmap_png, heatmap_title

    records = [
        {**_rec("save.write", 0, 2.0), "save_id": "20261206T000000-abc"},
        {**_rec("save.write", 1, 2.5), "save_id": "20261206T000000-abc"},
        {**_rec("save.plan", 1, 0.5), "save_id": "20261206T000000-abc"},
    ]
    rep = Report.build(records)
    title = heatmap_title(rep, records, "phases at /ckpts/step_100")
    assert "/ckpts/step_100" in title and "20261206T000000-abc" in title and "total 3.000 s" in title
    fig = heatmap_figure(rep, title)
    ax = fig.axes[0]
    assert ax.get_title() == title
    cells = sorted(t.get_text() for t in ax.texts)
    assert cells == ["0.000", "0.500", "2.000", "2.500"]  # rank 0 has no save.plan: 0
    assert ax.images[0].get_clim() == (0.0, 2.5)  # not from the smallest value
    heatmap_png(rep, str(tmp_path / "h.png"), title)
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
