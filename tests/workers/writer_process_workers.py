"""Rank function of tests/integration/engine/test_writer_process.py (module level, so that
``run_ranks`` can import it): two gloo ranks saving through writer processes
(``SaveOptions(writer="process")``). Returns plain values."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

import unickpt
from unickpt.errors import CheckpointError
from unickpt.options import SaveOptions


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))
    fully_shard(model)  # each rank writes its own shards: its own files, its own writer
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optim, seed)
    return model, optim


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 64, generator=g)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _full(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The whole state as full tensors (torch's own APIs: the reference, not unickpt's)."""
    out = {f"model.{k}": v.full_tensor().clone() for k, v in model.state_dict().items()}
    for i, st in optim.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim():
                out[f"optim.{i}.{k}"] = v.full_tensor().clone()
    return out


def _loads_exact(ckpt: unickpt.Checkpointer, path: str, want: dict[str, torch.Tensor]) -> bool:
    model, optim = _model(seed=99)
    ckpt.load(path, {"model": model, "optimizer": optim})
    got = _full(model, optim)
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def save_kill_close(rank: int, ws: int, root: str) -> dict:
    """1. an async save through the writer process loads back bit-exact; 2. rank 1's writer is
    SIGKILLed after the next save's snapshot, before its files are written: that save fails on
    every rank with the writer's death named, and the first checkpoint still loads bit-exact;
    3. the save after it starts a new writer and commits, and the failed save's files are gone;
    4. ``close()`` stops the writer (the process no longer exists)."""
    out: dict = {}
    path = os.path.join(root, "ckpt")
    model, optim = _model(seed=rank + 1)
    state = {"model": model, "optimizer": optim}
    victim: dict = {"armed": False, "killed": None}
    ckpt = unickpt.Checkpointer(save_options=SaveOptions(writer="process"))
    writer = ckpt.resources.staging.writer
    receive = writer._receive

    def kill_in_flight(sock):  # the save worker sent a write request: rank 1 kills its writer now
        if victim["armed"] and writer._ready:
            victim["killed"], victim["armed"] = writer.pid, False
            os.kill(victim["killed"], signal.SIGKILL)
        return receive(sock)

    writer._receive = kill_in_flight  # type: ignore[method-assign]
    # 1. save + load bit-exact
    first = _full(model, optim)
    ckpt.save(path, state, async_save=True).wait()
    pid1 = ckpt.resources.staging.writer.pid
    out["writer_started"] = pid1 is not None and pid1 != os.getpid()
    with open(f"/proc/{pid1}/maps") as f:  # it boots without torch (writer_main.BOOTSTRAP)
        out["writer_without_torch"] = "libtorch" not in f.read()
    out["first_exact"] = _loads_exact(ckpt, path, first)
    data = os.path.join(path, "data")
    committed_before = set(os.listdir(data))

    # 2. the writer killed mid-save (rank 1 only)
    _step(model, optim, 7)
    victim["armed"] = rank == 1
    handle = ckpt.save(path, state, async_save=True)
    try:
        handle.wait()
        out["kill_error"] = None
    except CheckpointError as e:
        out["kill_error"] = f"{type(e).__name__}: {e}"
    out["killed_pid_was_writer"] = rank != 1 or victim["killed"] == pid1
    out["previous_intact"] = _loads_exact(ckpt, path, first)

    # 3. the next save starts a new writer and commits; the failed save's data is removed
    _step(model, optim, 8)
    third = _full(model, optim)
    ckpt.save(path, state, async_save=True).wait()
    pid3 = ckpt.resources.staging.writer.pid
    out["new_writer"] = pid3 is not None and (rank != 1 or pid3 != pid1)
    out["third_exact"] = _loads_exact(ckpt, path, third)
    out["data_after"] = sorted(set(os.listdir(data)) - committed_before)
    out["data_kept_first"] = committed_before <= set(os.listdir(data))

    # 4. close() stops the writer
    ckpt.close()
    out["closed_pid"] = ckpt.resources.staging.writer.pid
    out["process_gone"] = not os.path.exists(f"/proc/{pid3}")
    return out
