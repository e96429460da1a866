"""Issue 39 item 24 on real gloo ranks: ``TokenPackingLoader(epochs=1)`` gives every DP rank the
same number of full batches, so a 3-rank job whose steps do a collective per batch reaches the
end of the data on every rank (before, the ranks ran out at different steps and the job died
in the collective), fresh and after a resume from 2 ranks, repeating no token."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.workers.even_loader_workers import train_to_end
from tests.workers.harness import run_ranks
from tests.workers.loader_data import LENGTHS, all_tokens, write_dataset

SEQ_LEN, BATCH, BLOCK, PARTS = 37, 3, 50, 12  # loader_data.make_loader's settings


def _rows_per_rank(ws: int) -> list[int]:
    """The oracle, from the file lengths: part p holds the blocks b = p, p + PARTS, ... of every
    source; its tokens pack into ceil(tokens / SEQ_LEN) rows; rank r owns the parts p % ws == r."""
    tokens = [0] * PARTS
    for lengths in LENGTHS.values():
        total = sum(lengths)
        for b in range(math.ceil(total / BLOCK)):
            tokens[b % PARTS] += min(BLOCK, total - b * BLOCK)
    rows = [0] * ws
    for p in range(PARTS):
        rows[p % ws] += math.ceil(tokens[p] / SEQ_LEN)
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("even")
    sources = write_dataset(str(tmp / "data"))
    ck = str(tmp / "ck")
    return {
        "sources": sources,
        "fresh3": run_ranks(train_to_end, 3, sources, str(tmp / "unused"), False, None, timeout=120),
        "before2": run_ranks(train_to_end, 2, sources, ck, False, 2, timeout=120),
        "after3": run_ranks(train_to_end, 3, sources, ck, True, None, timeout=120),
    }


def test_issue39_item24_three_ranks_reach_the_end_of_the_data_together(runs: dict[str, Any]) -> None:
    rows = _rows_per_rank(3)
    assert len(set(rows)) > 1  # the ranks' data differ: without equal batches they stop apart
    want = min(rows) // BATCH
    fresh = runs["fresh3"]
    assert [r["steps"] for r in fresh] == [want] * 3
    assert all(r["rows"] == [BATCH] * want for r in fresh)  # every batch full
    seen = [t for r in fresh for t in r["tokens"]]
    assert len(seen) == len(set(seen))  # nothing repeated
    # what is dropped is the end: fewer than one batch on the rank with the fewest rows
    assert len(all_tokens(runs["sources"])) - len(seen) <= (sum(rows) - 3 * want * BATCH) * SEQ_LEN


def test_issue39_item24_resume_on_three_ranks_repeats_nothing_and_ends_together(runs: dict[str, Any]) -> None:
    before, after = runs["before2"], runs["after3"]
    assert [r["steps"] for r in before] == [2, 2]
    steps = [r["steps"] for r in after]
    assert steps[0] > 0 and steps == [steps[0]] * 3
    assert all(r["rows"] == [BATCH] * steps[0] for r in after)
    seen = [t for r in before + after for t in r["tokens"]]
    assert len(seen) == len(set(seen))  # exactly once across the resume
    # only the end is dropped: at most the rows of less than two batches per rank
    assert len(all_tokens(runs["sources"])) - len(seen) < 3 * 2 * BATCH * SEQ_LEN
