"""Lightning's own checkpoint tests (vendored from Lightning 2.6.5, see each file's header) run
with unickpt's strategies substituted for Lightning's default one (``lightning_suite_support``),
with synchronous saves, and those in ``ASYNC_TOO`` (saves, top-k removal and resumes close
together) once more with asynchronous saves. Each test gets its environment back and
leaves no process group behind (Lightning's DDP sets ``MASTER_PORT`` & co. and initialises gloo)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest.importorskip("lightning")


import torch.distributed as dist

import unickpt
from tests.integration.integrations.lightning_suite.lightning_suite_support import use_unickpt_strategy

# upstream tests run with asynchronous saves too (a pending save removed, resumed from, or saved over)
ASYNC_TOO = {
    "test_model_checkpoint_save_last",
    "test_model_checkpoint_topk_all",
    "test_ckpt_every_n_train_steps",
    "test_resume_training_preserves_old_ckpt_last",
    "test_resume_and_old_checkpoint_files_remain",
    "test_finetuning_with_ckpt_path",
    "test_loops_restore",
    "test_restore_callbacks_in_non_fit_phases",
    "test_correct_step_and_epoch",
    "test_restarting_mid_epoch_raises_warning",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "unickpt_strategy" in metafunc.fixturenames:
        modes = ["sync", "async"] if metafunc.function.__name__ in ASYNC_TOO else ["sync"]
        metafunc.parametrize("unickpt_strategy", modes, indirect=True)


@pytest.fixture(autouse=True)
def unickpt_strategy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    env = dict(os.environ)
    use_unickpt_strategy(monkeypatch, async_save=request.param == "async")
    try:
        yield request.param
    finally:
        unickpt.wait_all()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
