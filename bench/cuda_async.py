"""CUDA checkpointing on one GPU: unickpt vs PyTorch DCP, async and sync, in one run.

A stack of Linear layers with Adam state (``--gib`` in total) lives on the GPU. Each round,
interleaved (A then B, repeated ``--repeats`` times, medians reported):

- async save: the time ``save`` blocks the training loop (unickpt: pinned staging buffers filled
  by a side-stream device-to-host copy, the next kernels ordered after it; DCP: ``async_save``),
  then ``--steps`` training steps run while the write goes on, then the wait for the commit;
- sync save: wall time of a blocking save;
- load: wall time to load the checkpoint back into a GPU model (host-to-device copies included),
  checked bit-exact against the state at the save.

Run where a GPU is present (``python bench/cuda_async.py --gib 4``); ``--device cpu`` runs the
same code on the CPU for a smoke test. Numbers: seconds, GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import unickpt
from _common import dcp_state_dict, device_model, model_shape, sync_device, table, train_step


def _state_sums(model: Any, optim: Any) -> list[torch.Tensor]:
    """A copy of every tensor, on the host (the expected values of the load check)."""
    out = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    for st in optim.state.values():
        out += [v.to("cpu", copy=True) for v in st.values() if torch.is_tensor(v)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def async_round(tool: str, model: Any, optim: Any, x: torch.Tensor, path: str, steps: int, device: str) -> dict:
    sync_device(device)
    t0 = time.perf_counter()
    if tool == "unickpt":
        handle = unickpt.save(path, {"model": model, "optimizer": optim}, async_save=True)
    else:
        import torch.distributed.checkpoint as dcp

        handle = dcp.async_save(dcp_state_dict(model, optim), checkpoint_id=path)
    blocked = time.perf_counter() - t0
    for _ in range(steps):
        train_step(model, optim, x)
    sync_device(device)
    t_steps = time.perf_counter() - t0 - blocked
    if tool == "unickpt":
        handle.wait()
    else:
        handle.result()
    return {"blocked": blocked, "steps": t_steps, "total": time.perf_counter() - t0}


def sync_save(tool: str, model: Any, optim: Any, path: str, device: str) -> float:
    sync_device(device)
    t0 = time.perf_counter()
    if tool == "unickpt":
        unickpt.save(path, {"model": model, "optimizer": optim}).wait()
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(dcp_state_dict(model, optim), checkpoint_id=path)
    return time.perf_counter() - t0


def load(tool: str, model: Any, optim: Any, path: str, device: str) -> float:
    sync_device(device)
    t0 = time.perf_counter()
    if tool == "unickpt":
        unickpt.load(path, {"model": model, "optimizer": optim})
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sd = dcp_state_dict(model, optim)
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    sync_device(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="params + Adam state, GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="training steps run during an async save")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default=None, help="parent of the checkpoint folders (default /tmp)")
    args = ap.parse_args()
    device = args.device
    layers, dim = model_shape(args.gib)
    model, optim = device_model(layers, dim, device)
    x = torch.randn(64, dim, device=device)
    train_step(model, optim, x)
    nbytes = sum(t.numel() * t.element_size() for t in _state_sums(model, optim))
    root = tempfile.mkdtemp(prefix="cuda_async_", dir=args.dir)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else device}; torch {torch.__version__}")
    print(f"state {nbytes / 2**30:.2f} GiB ({layers} x Linear({dim}, {dim}) + Adam); root {root}")
    res: dict[str, dict[str, list[float]]] = {t: {} for t in ("unickpt", "dcp")}
    tools = ("unickpt", "dcp")
    try:
        for rep in range(args.repeats + 1):  # round 0 warms both (plans, pinned buffers, CUDA context)
            for tool in tools if rep % 2 == 0 else tools[::-1]:
                p = os.path.join(root, f"{tool}_{rep}")
                a = async_round(tool, model, optim, x, p + "_async", args.steps, device)
                s = sync_save(tool, model, optim, p + "_sync", device)
                want = _state_sums(model, optim)
                fresh, fopt = device_model(layers, dim, device, seed=1)
                train_step(fresh, fopt, x)
                ld = load(tool, fresh, fopt, p + "_sync", device)
                if not _same(_state_sums(fresh, fopt), want):
                    raise SystemExit(f"{tool}: loaded state differs from the saved state")
                del fresh, fopt
                shutil.rmtree(p + "_async", ignore_errors=True)
                shutil.rmtree(p + "_sync", ignore_errors=True)
                if rep == 0:
                    continue
                for k, v in (*a.items(), ("sync save", s), ("load", ld)):
                    res[tool].setdefault(k, []).append(v)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    labels = {
        "blocked": "async save: blocking",
        "steps": f"  {args.steps} steps during it",
        "total": "  until committed",
    }
    for key in ("blocked", "steps", "total", "sync save", "load"):
        u, d = statistics.median(res["unickpt"][key]), statistics.median(res["dcp"][key])
        rows.append([labels.get(key, key), f"{u:.3f}", f"{d:.3f}", f"{d / u:.2f}x"])
    print(table("median seconds (DCP / unickpt: >1 means unickpt is faster)", ["", "unickpt", "DCP", "ratio"], rows))


if __name__ == "__main__":
    main()
