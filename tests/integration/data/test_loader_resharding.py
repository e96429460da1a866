"""Dataloader state through unickpt.save / load on real gloo ranks (issue 13): a protocol loader
saved by 2 DP ranks resumes on 3 (and on 1) with every token of the dataset consumed exactly
once; a loader without the protocol is refused after a change of world size instead of being
silently replayed (``r % old_size``), or left alone on request.

The checks share seven spawned jobs (``loader_runs``: one per world size and phase; every load
runs in a later job than the save it reads, as a resumed job would) instead of one per call."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from tests.workers.harness import run_ranks
from tests.workers.loader_data import all_tokens, write_dataset
from tests.workers.loader_workers import run_steps
from unickpt.format.codec import decode_metadata

HAVE_TORCHDATA = importlib.util.find_spec("torchdata") is not None


@pytest.fixture(scope="module")
def loader_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every step's per-rank results by label, plus the dataset (``sources``) and the folders."""
    tmp = tmp_path_factory.mktemp("loader")
    sources = write_dataset(str(tmp / "data"))
    ck = {name: str(tmp / name) for name in ("drain", "plain", "plain2", "extra", "none", "dropout", "tp", "torchdata")}
    phases: list[tuple[int, list[list[Any]]]] = [
        (
            2,
            [
                ["save_drain", "save_after_some_batches", [sources, ck["drain"]]],
                ["save_plain", "save_plain", [ck["plain"]]],
                ["save_plain2", "save_plain", [ck["plain2"]]],
                ["save_extra", "save_extra", [ck["extra"]]],
                ["save_none", "save_without_loader", [ck["none"]]],
            ]
            + ([["torchdata", "stateful_dataloader_round_trip", [ck["torchdata"]]]] if HAVE_TORCHDATA else []),
        ),
        (
            2,
            [
                ["plain_ws2", "load_plain", [ck["plain"], "error"]],
                ["extra_ws2", "load_extra", [ck["extra"], "error"]],
                ["into_loader_strict", "load_into_protocol_loader", [sources, ck["none"], True]],
                ["into_loader_loose", "load_into_protocol_loader", [sources, ck["none"], False]],
                ["without_loader_strict", "load_without_loader", [ck["plain2"], True]],
                ["without_loader_loose", "load_without_loader", [ck["plain2"], False]],
            ],
        ),
        (
            3,
            [
                ["drain_ws3", "load_and_drain", [sources, ck["drain"]]],
                ["extra_modulo", "load_extra", [ck["extra"], "modulo"]],
                ["extra_rank0", "load_extra", [ck["extra"], "rank0"]],
                ["extra_skip", "load_extra", [ck["extra"], "skip"]],
            ],
        ),
        (
            1,
            [
                ["drain_ws1", "load_and_drain", [sources, ck["drain"]]],
                ["plain_refused", "load_plain", [ck["plain"], "error"]],
                ["plain_skipped", "load_plain", [ck["plain"], "skip"]],
                ["extra_ws1", "load_extra", [ck["extra"], "error"]],
                ["dropout_full", "dropout_run", [ck["dropout"], 8, None]],
                ["dropout_first", "dropout_run", [ck["dropout"], 8, 3]],
            ],
        ),
        (1, [["dropout_resumed", "dropout_run", [ck["dropout"], -8, 3]]]),
        (4, [["tp_save", "tp_job", [sources, ck["tp"], "save"]]]),
        (4, [["tp_load", "tp_job", [sources, ck["tp"], "load"]]]),
    ]
    out: dict[str, Any] = {"sources": sources, "ck": ck}
    for world_size, steps in phases:
        per_rank = run_ranks(run_steps, world_size, steps)
        for label, _, _ in steps:
            out[label] = [r[label] for r in per_rank]
    return out


def test_issue13_loader_saved_by_2_ranks_resumes_on_3_and_1_exactly_once(loader_runs):
    sources, ck = loader_runs["sources"], loader_runs["ck"]["drain"]
    before = loader_runs["save_drain"]
    with open(f"{ck}/unickpt.metadata.json", "rb") as f:
        md = decode_metadata(f.read(), "ck")
    section = md.sections["dataloader"]
    assert section.num_parts == 12 and md.format_version == 3
    assert sum(k.startswith("dataloader/part-") for k in md.blobs) == 12
    want = all_tokens(sources)
    for ws in (3, 1):
        after = loader_runs[f"drain_ws{ws}"]
        consumed = [t for r in before for t in r] + [t for r in after for t in r]
        assert sorted(consumed) == want, ws


def test_issue13_plain_loader_is_refused_after_a_resize_not_replayed(loader_runs):
    assert loader_runs["plain_ws2"] == [{"pos": 10, "warned": False}, {"pos": 11, "warned": False}]
    refused = loader_runs["plain_refused"][0]
    assert "error" in refused and "per-rank dataloader state of 2 ranks" in refused["error"] and refused["pos"] == -1
    skipped = loader_runs["plain_skipped"][0]
    assert skipped == {"pos": -1, "warned": True}


def test_issue13_extra_state_on_resize_is_a_choice(loader_runs):
    modulo = loader_runs["extra_modulo"]
    assert [r["rank"] for r in modulo] == [0, 1, 0] and modulo[0]["warned"]
    assert [r["rank"] for r in loader_runs["extra_rank0"]] == [0, 0, 0]
    assert [r["rank"] for r in loader_runs["extra_skip"]] == ["untouched"] * 3
    refused = loader_runs["extra_ws1"][0]
    assert "saved per rank by 2 ranks" in refused["error"]
    assert [r["rank"] for r in loader_runs["extra_ws2"]] == [0, 1]  # same size: no choice needed


def test_issue13_checkpoint_without_loader_into_a_job_with_one(loader_runs):
    strict = loader_runs["into_loader_strict"]
    assert all(r.startswith("MissingKeysError") and "dataloader" in r for r in strict), strict
    loose = loader_runs["into_loader_loose"]
    assert "dataloader" in loose[0], loose


def test_issue13_stateful_dataloader_same_size(loader_runs):
    pytest.importorskip("torchdata")
    rest = loader_runs["torchdata"]
    assert len(rest) == 2 and all(len(r) == 7 for r in rest)


def test_issue13_only_loader_owning_ranks_save_and_load(loader_runs):
    """Megatron-style ownership: the loader's dp_rank/dp_size decide, not the world rank; ranks
    without a loader neither save nor need one."""
    before = loader_runs["tp_save"]
    assert before[1] == before[3] == []
    after = loader_runs["tp_load"]
    consumed = [t for r in before + after for t in r]
    assert sorted(consumed) == all_tokens(loader_runs["sources"])


def test_issue13_same_size_resume_gives_bit_identical_losses_with_dropout(loader_runs):
    full = loader_runs["dropout_full"][0]
    first = loader_runs["dropout_first"][0]
    resumed = loader_runs["dropout_resumed"][0]
    assert first == full
    assert resumed == full[3:]


def test_issue13_checkpoint_with_loader_into_a_job_without_one(loader_runs):
    strict = loader_runs["without_loader_strict"]
    assert all(r.startswith("UnexpectedKeysError") and "dataloader" in r for r in strict), strict
    loose = loader_runs["without_loader_loose"]
    assert "dataloader" in loose[0] and loose[0].startswith("warned"), loose
