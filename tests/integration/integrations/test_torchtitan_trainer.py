"""torchtitan's own ``Trainer`` with ``UnickptCheckpointManager`` as its checkpoint manager, chosen
through ``Trainer.Config.checkpoint`` (tests/workers/torchtitan_trainer_workers.py), on one GPU:
an uninterrupted 6-step run (async saves every 2 steps) against a second ``Trainer`` resumed from
the first run's step-4 checkpoint: the losses torchtitan logged for steps 5 and 6, the parameters,
the optimizer state and the schedulers at the end are bit-exact. Then the GPU run's last
checkpoint loads on 2 CPU processes (gloo, FSDP2) into the same config's model, optimizer and
scheduler containers, bit-exact.

CUDA only: torchtitan 0.3.0 has no CPU device (``tools.utils.device_type`` falls back to
``"cuda"``; its metrics' memory monitor and ``set_pg_timeouts`` call ``torch.cuda``-style device
functions that ``torch.cpu`` lacks), and its FlexAttention has no backward on CPU. One process:
NCCL cannot put two ranks on one GPU. Expected values are the uninterrupted run's own tensors and
losses as torchtitan's objects and its TensorBoard logger hold them, never read through unickpt.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.workers.harness import run_ranks as run_cpu_ranks
from tests.workers.torchtitan_trainer_workers import (
    RESUME_STEP,
    STEPS,
    load_on_cpu,
    make_assets,
    run_trainer_pair,
)
from unickpt.testing.launch import free_port
from unickpt.testing.launch import run_ranks as run_process

if not torch.cuda.is_available():  # before the imports below (seconds of CPU for a skip)
    pytest.skip("torchtitan's Trainer needs a CUDA device", allow_module_level=True)

# the packages its trainer imports (torchtitan.trainer itself is imported by the worker, after
# its torch compatibility names: tests/workers/torchtitan_trainer_workers.py, _torch_compat)
for _name in ("torchtitan", "torchdata", "tyro", "spmd_types", "datasets", "tensorboard", "tokenizers"):
    pytest.importorskip(_name)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: {sorted(set(a) ^ set(b))[:5]}"
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"{what} differ: {bad[:5]}"


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("titan_trainer"))
    tok_dir, data_dir = make_assets(root)
    (out,) = run_process(run_trainer_pair, 0, root, tok_dir, data_dir, free_port(), timeout=300)
    return root, tok_dir, data_dir, out


def test_trainer_resumed_from_unickpt_checkpoint_equals_uninterrupted_run(gpu_runs) -> None:
    _, _, _, out = gpu_runs
    full, resumed = out["full"], out["resumed"]
    assert full["device"].startswith("cuda") and resumed["device"].startswith("cuda")
    assert out["folders"] == [f"step-{s}" for s in range(2, STEPS + 1, 2)]
    assert sorted(full["losses"]) == list(range(1, STEPS + 1))
    assert sorted(resumed["losses"]) == list(range(RESUME_STEP + 1, STEPS + 1))  # it started at step 5
    assert full["losses"][1] != full["losses"][STEPS]  # it trained
    for step in range(RESUME_STEP + 1, STEPS + 1):
        assert resumed["losses"][step] == full["losses"][step], step
    assert full["step"] == resumed["step"] == STEPS
    _equal(full["params"], resumed["params"], "parameters")
    _equal(full["optim"], resumed["optim"], "optimizer state")
    assert full["sched"] == resumed["sched"] == [STEPS]


def test_gpu_checkpoint_loads_on_two_cpu_processes(gpu_runs) -> None:
    root, tok_dir, data_dir, out = gpu_runs
    ranks = run_cpu_ranks(load_on_cpu, 2, root, tok_dir, data_dir, timeout=180)
    for r in ranks:
        assert r["loaded"] is True and r["step"] == STEPS
        _equal(out["full"]["params"], r["params"], "parameters at ws=2")
        _equal(out["full"]["optim"], r["optim"], "optimizer state at ws=2")
        assert r["sched"] == [STEPS]
    assert os.path.isdir(os.path.join(root, "full", "checkpoint", f"step-{STEPS}"))
