"""Every save keeps its per-rank phase records inside the checkpoint (``SaveOptions.record_phases``,
on by default), so that ``unickpt report CKPT`` works on any checkpoint saved by this version
(issue 26, item 14).

Its tests that start processes are in ``tests/integration/monitoring/test_phases_processes.py``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch import nn

import unickpt
from tests.fixtures.golden_v1 import GOLDEN
from unickpt.cli import main
from unickpt.errors import CorruptMetadataError
from unickpt.monitoring.phases import MAX_ROWS_PER_RANK, decode_phases, encode_phases


def _save_id(path: str) -> str:
    with open(os.path.join(path, "unickpt.metadata.json")) as f:
        return json.load(f)["save_id"]


def test_issue26_item14_old_checkpoint_loads_and_reports_no_records(tmp_path, capsys):
    ckpt = str(tmp_path / "golden")
    shutil.copytree(os.path.join(GOLDEN, "v1_fsdp2_ws3"), ckpt)
    assert main(["verify", ckpt]) == 0  # every byte still reads and checks
    capsys.readouterr()
    assert main(["report", ckpt]) == 1
    assert f"{ckpt}: no phase records in this checkpoint" in capsys.readouterr().out


def test_issue26_item14_records_go_with_their_save_data(tmp_path):
    """The cleanup of older saves removes their phase records with their data (the data marker
    covers them): no folder of an old save is left behind."""
    path = str(tmp_path / "ck")
    model = nn.Linear(4, 3)
    ids = []
    for _ in range(3):
        unickpt.save(path, {"model": model})
        ids.append(_save_id(path))
    # kept: the committed save and the one it replaced (folder.cleanup.remove_stale_data)
    assert sorted(os.listdir(os.path.join(path, "data"))) == sorted(ids[1:])
    for sid in ids[1:]:
        assert "phases.json" in os.listdir(os.path.join(path, "data", sid))
    fresh = nn.Linear(4, 3)
    unickpt.load(path, {"model": fresh})
    assert torch.equal(fresh.weight, model.weight)


def test_issue26_item14_durable_tier_copy_keeps_the_records(tmp_path, capsys):
    from unickpt.storage import open_storage
    from unickpt.tiering import copy_checkpoint

    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    unickpt.save(fast, {"model": nn.Linear(4, 3)})
    copy_checkpoint(open_storage(fast), open_storage(durable))
    sid = _save_id(durable)
    assert main(["report", durable]) == 0
    assert f"phases of save {sid} at {durable} (1 rank(s)" in capsys.readouterr().out


def test_issue26_item14_malformed_records_are_refused_precisely():
    good = encode_phases("s1", [[["save.write", 1.5, 0.25, 10, ""]], []])
    assert decode_phases(good, "x") == [
        {"phase": "save.write", "rank": 0, "start_unix": 1.5, "seconds": 0.25, "bytes": 10, "path": "", "save_id": "s1"}
    ]
    too_many = encode_phases("s1", [[["save.write", 1.0, 0.1, 1, ""]] * (MAX_ROWS_PER_RANK + 1)])
    bad = {
        "not json": b"\xff{",
        "other format": json.dumps({"format": "x", "version": 1, "ranks": []}).encode(),
        "newer version": json.dumps({"format": "unickpt.phases", "version": 2, "ranks": []}).encode(),
        "negative seconds": encode_phases("s", [[["save.write", 1.0, -1.0, 1, ""]]]),
        "bool bytes": encode_phases("s", [[["save.write", 1.0, 1.0, True, ""]]]),
        "short row": encode_phases("s", [[["save.write", 1.0]]]),
        "too many rows": too_many,
    }
    for why, data in bad.items():
        with pytest.raises(CorruptMetadataError, match="where.json"):
            decode_phases(data, "where.json")
        assert why
