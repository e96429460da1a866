"""The Hugging Face Trainer's own checkpoint tests (the scenarios of transformers'
``tests/trainer/``, rewritten here: see each module's docstring) run against
``unickpt.integrations.hf_trainer``: every Trainer these tests build is a ``UnickptTrainer``, so
every checkpoint they save and resume goes through unickpt. One
process, no process group, in the test's own working directory. Tests named in ``ASYNC_TOO``
(rotation and resume close behind a save) run a second time with ``unickpt_async_save = True``;
every test leaves no pending save behind."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import unickpt
from unickpt.integrations.hf_trainer import UnickptTrainer

# tests run with asynchronous saves too: save_total_limit rotation behind a pending save, a
# resume from the last save of the run before, best-model reloads
ASYNC_TOO = {
    "test_can_resume_training",
    "test_resume_training_with_gradient_accumulation",
    "test_load_best_model_with_save",
    "test_best_model_checkpoint_behavior",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "save_mode" in metafunc.fixturenames:
        modes = ["sync", "async"] if metafunc.function.__name__ in ASYNC_TOO else ["sync"]
        metafunc.parametrize("save_mode", modes)


@pytest.fixture(autouse=True)
def unickpt_trainer(save_mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(UnickptTrainer, "unickpt_async_save", save_mode == "async")
    try:
        yield
    finally:
        unickpt.wait_all()
