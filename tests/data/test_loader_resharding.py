"""Dataloader state through unickpt.save / load on real gloo ranks (issue 13): a protocol loader
saved by 2 DP ranks resumes on 3 (and on 1) with every token of the dataset consumed exactly
once; a loader without the protocol is refused after a change of world size instead of being
silently replayed (``r % old_size``), or left alone on request."""

from __future__ import annotations

import pytest
from loader_data import all_tokens, write_dataset
from loader_workers import (
    dropout_run,
    load_and_drain,
    load_extra,
    load_into_protocol_loader,
    load_plain,
    load_without_loader,
    save_after_some_batches,
    save_extra,
    save_plain,
    save_without_loader,
    stateful_dataloader_round_trip,
    tp_job,
)

from harness import run_ranks
from unickpt.format.codec import decode_metadata


def test_issue13_loader_saved_by_2_ranks_resumes_on_3_and_1_exactly_once(tmp_path):
    sources = write_dataset(str(tmp_path / "data"))
    ck = str(tmp_path / "ck")
    before = run_ranks(save_after_some_batches, 2, sources, ck)
    with open(f"{ck}/unickpt.metadata.json", "rb") as f:
        md = decode_metadata(f.read(), "ck")
    section = md.sections["dataloader"]
    assert section.num_parts == 12 and md.format_version == 3
    assert sum(k.startswith("dataloader/part-") for k in md.blobs) == 12
    want = all_tokens(sources)
    for ws in (3, 1):
        after = run_ranks(load_and_drain, ws, sources, ck)
        consumed = [t for r in before for t in r] + [t for r in after for t in r]
        assert sorted(consumed) == want, ws


def test_issue13_plain_loader_is_refused_after_a_resize_not_replayed(tmp_path):
    ck = str(tmp_path / "ck")
    run_ranks(save_plain, 2, ck)
    assert run_ranks(load_plain, 2, ck, "error") == [{"pos": 10, "warned": False}, {"pos": 11, "warned": False}]
    refused = run_ranks(load_plain, 1, ck, "error")[0]
    assert "error" in refused and "per-rank dataloader state of 2 ranks" in refused["error"] and refused["pos"] == -1
    skipped = run_ranks(load_plain, 1, ck, "skip")[0]
    assert skipped == {"pos": -1, "warned": True}


def test_issue13_extra_state_on_resize_is_a_choice(tmp_path):
    ck = str(tmp_path / "ck")
    run_ranks(save_extra, 2, ck)
    modulo = run_ranks(load_extra, 3, ck, "modulo")
    assert [r["rank"] for r in modulo] == [0, 1, 0] and modulo[0]["warned"]
    assert [r["rank"] for r in run_ranks(load_extra, 3, ck, "rank0")] == [0, 0, 0]
    assert [r["rank"] for r in run_ranks(load_extra, 3, ck, "skip")] == ["untouched"] * 3
    refused = run_ranks(load_extra, 1, ck, "error")[0]
    assert "saved per rank by 2 ranks" in refused["error"]
    assert [r["rank"] for r in run_ranks(load_extra, 2, ck, "error")] == [0, 1]  # same size: no choice needed


def test_issue13_checkpoint_without_loader_into_a_job_with_one(tmp_path):
    sources = write_dataset(str(tmp_path / "data"))
    ck = str(tmp_path / "ck")
    run_ranks(save_without_loader, 2, ck)
    strict = run_ranks(load_into_protocol_loader, 2, sources, ck, True)
    assert all(r.startswith("MissingKeysError") and "dataloader" in r for r in strict), strict
    loose = run_ranks(load_into_protocol_loader, 2, sources, ck, False)
    assert "dataloader" in loose[0], loose


def test_issue13_stateful_dataloader_same_size(tmp_path):
    pytest.importorskip("torchdata")
    rest = run_ranks(stateful_dataloader_round_trip, 2, str(tmp_path / "ck"))
    assert len(rest) == 2 and all(len(r) == 7 for r in rest)


def test_issue13_only_loader_owning_ranks_save_and_load(tmp_path):
    """Megatron-style ownership: the loader's dp_rank/dp_size decide, not the world rank; ranks
    without a loader neither save nor need one."""
    sources = write_dataset(str(tmp_path / "data"))
    ck = str(tmp_path / "ck")
    before = run_ranks(tp_job, 4, sources, ck, "save")
    assert before[1] == before[3] == []
    after = run_ranks(tp_job, 4, sources, ck, "load")
    consumed = [t for r in before + after for t in r]
    assert sorted(consumed) == all_tokens(sources)


def test_issue13_same_size_resume_gives_bit_identical_losses_with_dropout(tmp_path):
    ck = str(tmp_path / "ck")
    full = run_ranks(dropout_run, 1, ck, 8, None)[0]
    first = run_ranks(dropout_run, 1, ck, 8, 3)[0]
    resumed = run_ranks(dropout_run, 1, ck, -8, 3)[0]
    assert first == full
    assert resumed == full[3:]


def test_issue13_checkpoint_with_loader_into_a_job_without_one(tmp_path):
    ck = str(tmp_path / "ck")
    run_ranks(save_plain, 2, ck)
    strict = run_ranks(load_without_loader, 2, ck, True)
    assert all(r.startswith("UnexpectedKeysError") and "dataloader" in r for r in strict), strict
    loose = run_ranks(load_without_loader, 2, ck, False)
    assert "dataloader" in loose[0] and loose[0].startswith("warned"), loose
