"""FSDP through the frameworks' own wrapping, on one GPU: Lightning's ``FSDPStrategy`` (FSDP1,
``auto_wrap_policy``) with ``UnickptFSDPStrategy`` (Trainer) and ``UnickptFabricFSDPStrategy``
(Fabric), Accelerate's FSDP plugin (FSDP1 and FSDP2)
with ``unickpt.integrations.accelerate.save_state`` / ``load_state``, and the HF Trainer with
``TrainingArguments.fsdp`` and ``UnickptTrainerMixin``; then the checkpoints made there loaded at
2 processes on the CPU through DDP (another framework layout, another device, another world size).

Why a GPU: on CPU, Lightning's ``FSDPStrategy`` wraps with ``device_id=None``, which torch's
FSDP1 refuses ("FSDP needs a non-CPU accelerator device"), and Accelerate honours the FSDP plugin
only on an accelerator (``AcceleratorState``: on CPU it prepares DDP). The CPU tests cover FSDP1
wrapped by the user (test_lightning.py) and FSDP2 through ``ModelParallelStrategy``. One GPU runs
one rank (NCCL cannot put two ranks on one device), in this process; the CPU load is one spawn.

Expected values come from the frameworks: stock Lightning / Accelerate / Trainer checkpointing
resumed the same way, the uninterrupted run, and torch's full state dicts (``get_state_dict``)."""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from unickpt.ops.inspect import load_metadata

if not torch.cuda.is_available():  # before the frameworks' imports: the CPU suite pays nothing
    pytest.skip("FSDP through Lightning / Accelerate needs CUDA", allow_module_level=True)

pytest.importorskip("lightning")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

VERSIONS = (1, 2)  # Accelerate's fsdp_version


@contextmanager
def one_rank() -> Iterator[None]:
    """This process as rank 0 of 1 (what ``torchrun --nproc-per-node 1`` sets), deterministic
    kernels; the process group the frameworks start is destroyed at the end."""
    from tests.workers.harness import free_port

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_all(root: str, device: str) -> dict[str, Any]:
    """Everything on ``device`` in this process, then the CPU load at 2 processes (one spawn)."""
    from tests.workers import fsdp_gpu_workers as w
    from tests.workers.harness import run_ranks

    runs: dict[str, Any] = {}
    with one_rank():
        _part(runs, "lightning", w.lightning_fsdp1, root, device)
        _part(runs, "fabric", w.fabric_fsdp1, root, device)
        for v in VERSIONS:
            _part(runs, f"accelerate-v{v}", w.accelerate_fsdp, root, v)
            _part(runs, f"trainer-v{v}", w.trainer_fsdp, root, v)
    _part(runs, "cpu-ws2", run_ranks, w.load_on_cpu, 2, root, ",".join(map(str, VERSIONS)), timeout=300)
    _part(runs, "frameworks", lambda: {n: load_metadata(os.path.join(root, p))[1].topology.framework for n, p in SAVED})
    return runs


def _part(runs: dict[str, Any], name: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    """``runs[name] = fn(...)``; a failure is kept as its traceback (``runs["failed"]``), raised by
    the tests that read this part (``_part_of``), so one failing part does not hide the others."""
    try:
        runs[name] = fn(*args, **kwargs)
    except Exception:
        runs.setdefault("failed", {})[name] = traceback.format_exc()


def _part_of(runs: dict[str, Any], name: str) -> Any:
    failed = runs.get("failed", {})
    if name in failed:
        raise AssertionError(f"{name} failed:\n{failed[name]}")
    return runs[name]


# unickpt's checkpoints the runs made: what each records as the saving job's framework
SAVED = (
    ("lightning", "lightning/unickpt/epoch=0.ckpt"),
    ("fabric", "fabric/unickpt/step3"),
    *((f"accelerate-v{v}", f"accelerate-v{v}/unickpt") for v in VERSIONS),
    *((f"trainer-v{v}", f"trainer-v{v}/unickpt/checkpoint-4/unickpt") for v in VERSIONS),
)
FRAMEWORK = {1: "fsdp", 2: "fsdp2"}  # torch's FSDP1 / FSDP2 (fully_shard)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    return run_all(str(tmp_path_factory.mktemp("fsdp_gpu")), "cuda")


def _equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of the tensors (nested dicts) that differ in value, dtype or shape; other values by ==."""
    bad = [f"missing {k}" for k in a.keys() ^ b.keys()]
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if isinstance(x, dict) and isinstance(y, dict):
            bad += [f"{k}.{d}" for d in _equal(x, y)]
        elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                bad.append(str(k))
        elif x != y:
            bad.append(str(k))
    return bad


def check_lightning(runs: dict[str, Any]) -> None:
    assert _part_of(runs, "frameworks")["lightning"] == "fsdp"  # every rank saved its FSDP1 shards
    ours, stock = _part_of(runs, "lightning")["unickpt"], _part_of(runs, "lightning")["stock"]
    assert ours["losses"] == stock["losses"] and len(stock["losses"]) == 12  # checkpointing changes nothing
    for which in ("from-epoch0", "from-last"):
        # the weights fit(ckpt_path=...) loaded are the saved epoch's, bit-exact, as Lightning's own load
        saved = stock["epoch0" if which == "from-epoch0" else "epoch1"]
        assert _equal(ours[f"{which}/start"], saved) == [], which
        assert _equal(stock[f"{which}/start"], saved) == [], which
        assert ours[f"{which}/losses"] == stock[f"{which}/losses"], which
    assert ours["from-epoch0/losses"] == stock["losses"][6:]  # the uninterrupted run's epoch 1
    assert len(ours["from-last/losses"]) == 6


def check_accelerate(runs: dict[str, Any], version: int) -> None:
    run = _part_of(runs, f"accelerate-v{version}")
    assert run["fsdp"] and run["is_fsdp2"] == (version == 2)
    assert (
        _part_of(runs, "frameworks")[f"accelerate-v{version}"]
        == _part_of(runs, "frameworks")[f"trainer-v{version}"]
        == FRAMEWORK[version]
    )
    for backend in ("unickpt", "stock"):
        assert _equal(run[f"{backend}/loaded"], run["saved"]) == [], backend  # model and optimizer
        assert run[f"{backend}/losses"] == run["losses"][3:], backend  # the uninterrupted run's
    assert run["unickpt/scheduler"] == run["stock/scheduler"]
    trainer = _part_of(runs, f"trainer-v{version}")
    assert trainer["unickpt/fsdp"] and trainer["stock/fsdp"]
    assert trainer["unickpt/losses"] == trainer["stock/losses"] and len(trainer["stock/losses"]) == 6
    assert trainer["unickpt/resumed"] == trainer["stock/resumed"] == trainer["stock/losses"][4:]


def _any_order(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each optimizer group's parameter names sorted: FSDP1 lists them per FSDP unit
    (flat parameters), DDP in the model's order."""
    groups = [dict(g, params=sorted(g["params"])) for g in state["optimizer"]["param_groups"]]
    return {**state, "optimizer": {**state["optimizer"], "param_groups": groups}}


def check_loaded_on_cpu_at_2_processes(runs: dict[str, Any]) -> None:
    for rank in _part_of(runs, "cpu-ws2"):
        for name in ("lightning", "lightning-fsdp2"):  # through DDP, and resharded into FSDP2 at 2
            assert _equal(rank[name], _part_of(runs, "lightning")["stock"]["epoch0"]) == [], name
        for v in VERSIONS:
            loaded, saved = (
                _any_order(rank[f"accelerate-v{v}"]),
                _any_order(_part_of(runs, f"accelerate-v{v}")["saved"]),
            )
            assert _equal(loaded, saved) == [], v


def check_fabric(runs: dict[str, Any]) -> None:
    assert _part_of(runs, "frameworks")["fabric"] == "fsdp"
    fabric = _part_of(runs, "fabric")
    assert fabric["unickpt/losses"] == fabric["stock/losses"] and len(fabric["stock/losses"]) == 6
    # fabric.load then 3 steps: the uninterrupted run's steps 4 to 6, as with Fabric's own checkpoint
    assert fabric["unickpt/resumed"] == fabric["stock/resumed"] == fabric["stock/losses"][3:]


def test_lightning_fsdp_strategy_wrapping_resumes_like_stock_lightning(runs) -> None:
    check_lightning(runs)


def test_fabric_fsdp_strategy_wrapping_resumes_like_stock_fabric(runs) -> None:
    check_fabric(runs)


@pytest.mark.parametrize("version", VERSIONS)
def test_accelerate_fsdp_plugin_save_load_state_and_trainer_like_stock(runs, version) -> None:
    check_accelerate(runs, version)


def test_gpu_fsdp_checkpoints_load_at_2_cpu_processes_through_ddp_and_fsdp2(runs) -> None:
    check_loaded_on_cpu_at_2_processes(runs)
