"""unickpt as Hugging Face Accelerate's checkpoint backend (``unickpt.integrations.accelerate``),
against the real ``accelerate`` and ``transformers`` packages: a tiny Llama trained by an
``Accelerator`` on 2 gloo processes is saved with unickpt's ``save_state`` (async) and with
Accelerate's own ``accelerator.save_state``, then resumed on 2 (in the same spawn), 3 and 1
processes from each. Expected values come from Accelerate: at 2 processes the resumed losses
equal the uninterrupted run's and the RNG draws equal those right after the save; at every size
the weights, optimizer state, scheduler, custom object and step counter unickpt loaded equal what
Accelerate's own ``load_state`` loaded (bit-exact), and so do the next steps' losses. One spawn
per world size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.workers.accelerate_workers import SAVED_AT, resume, resume_trainer, stateful_loader, train
from tests.workers.harness import run_ranks
from unickpt.format.records import METADATA_FILE


def _check_resumed(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["differences"] == []
        assert r["unickpt/counters"] == [SAVED_AT, 7]  # the custom object and accelerator.step
        # Accelerate keeps the step in rank r's RNG file: a rank the saving job did not have keeps 0
        assert r["stock/counters"] == [SAVED_AT, 7 if rank < 2 else 0]
        assert r["unickpt/losses"] == r["stock/losses"]
        assert r["strict"] == "UnexpectedKeysError" and r["non-strict"] == "loaded"


def test_save_on_2_processes_resume_on_2_3_and_1_like_accelerate(tmp_path) -> None:
    root = str(tmp_path)
    on2 = run_ranks(train, 2, root, timeout=300)
    assert os.path.isfile(os.path.join(root, "unickpt", METADATA_FILE))  # a unickpt checkpoint folder
    _check_resumed(on2)
    for r in on2:  # at the saved size: the uninterrupted run, RNG included
        assert r["unickpt/losses"] == r["losses"][SAVED_AT:]
        assert r["unickpt/drawn"] == r["drawn"] == r["stock/drawn"]

    for r in on2:  # a stateful dataloader goes on where it was
        loader = r["loader"]
        assert loader["resumed"] == loader["expected"] and loader["expected"] != loader["before"]

    on3 = run_ranks(_resume_both, 3, root, timeout=300)
    _check_resumed(on3)
    # per-rank RNG after growing: rank r gets saved rank r % 2's generators
    for r in on3:  # its per-rank position cannot be split: refused, or skipped (from the start) on request
        assert r["loader"]["resize"] == "LoaderStateError"
    assert [r["loader"]["skipped"] for r in on3] == [[[0, 1]], [[2, 3]], [[4, 5]]]  # batch r of a fresh loader
    assert [r["unickpt/drawn"] for r in on3] == [on2[0]["drawn"], on2[1]["drawn"], on2[0]["drawn"]]

    on1 = run_ranks(_resume_both, 1, root, timeout=300)
    _check_resumed(on1)
    assert on1[0]["unickpt/drawn"] == on2[0]["drawn"]
    assert on1[0]["loader"]["resize"] == "LoaderStateError"

    # the HF Trainer: checkpoint-N folders, save_total_limit=2, trainer_state.json
    for r in on2:
        assert r["trainer/unickpt/losses"] == r["trainer/stock/losses"]  # checkpointing changes nothing
        assert len(r["trainer/stock/losses"]) == 6
    kept = ["checkpoint-4", "checkpoint-6"]
    assert on2[0]["trainer/unickpt/folders"] == on2[0]["trainer/stock/folders"] == kept
    for name in kept:
        folder = os.path.join(root, "hf", "unickpt", name)
        assert os.path.isfile(os.path.join(folder, "trainer_state.json"))
        assert os.path.isfile(os.path.join(folder, "unickpt", METADATA_FILE))
        assert not os.path.exists(os.path.join(folder, "optimizer.pt"))
    # resume_from_checkpoint=True from checkpoint-4: steps 5 and 6
    for r in on2:  # at the saved size: the uninterrupted run's losses, and stock's
        assert r["trainer/unickpt/resumed"] == r["trainer/stock/resumed"] == r["trainer/stock/losses"][4:]
    for results in (on3, on1):  # at other sizes: stock Trainer's resume at that size
        for r in results:
            assert len(r["trainer/stock/resumed"]) == 2
            assert r["trainer/unickpt/resumed"] == r["trainer/stock/resumed"]
        assert results[0]["trainer/unickpt/resumed-folders"] == ["checkpoint-4", "checkpoint-6"]


def _resume_both(rank: int, ws: int, root: str) -> dict:
    out = resume(rank, ws, root)
    out["loader"] = stateful_loader(rank, ws, root)
    out.update(resume_trainer(rank, ws, root))
    return out


def test_import_unickpt_does_not_import_accelerate_or_transformers() -> None:
    code = "import sys, unickpt; print(sorted({'accelerate', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert out.stdout.strip() == "[]"
