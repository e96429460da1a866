"""Runs documentation code examples in one process (``tests/test_doc_examples.py`` starts it).

``python doc_examples_worker.py SNIPPETS.json RESULTS.json``: SNIPPETS is a list of
``{"name", "code", "kind"}``; every snippet runs with ``exec`` in a fresh namespace that defines
the names the examples use (a tiny FSDP2 model on a one-rank gloo group, its optimizer,
``state``, ``step``, ``steps``, ``train_step(step)``, ``actor_group``, ``actor_state``,
``my_listener``), in a fresh working folder. ``kind == "resume"``: a training-loop example with a
``CheckpointManager``, run three times: uninterrupted for ``RESUME_STEPS`` steps; in another
folder, stopped after ``STOP_AT`` steps; then resumed there with a model built from another
seed; the resumed run's final weights and optimizer state must equal the uninterrupted run's,
bit for bit. RESULTS gets ``{name: null | "error text"}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

RESUME_STEPS = 300  # the examples save every 100 steps
STOP_AT = 250  # the interrupted run stops here: its newest checkpoint is the one after 200 steps


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _namespace(seed: int, steps: int) -> dict[str, Any]:
    import unickpt

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(step: int) -> None:
        if type(step) is not int:
            raise TypeError(f"train_step(step) takes the step index, got {step!r}")
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(4, 6, generator=g)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {
        "__name__": "__doc_example__",
        "unickpt": unickpt,
        "torch": torch,
        "model": model,
        "optimizer": optimizer,
        "state": {"model": model, "optimizer": optimizer},
        "step": 0,
        "steps": steps,
        "train_step": train_step,
        "actor_group": dist.new_group([0]),
        "actor_state": {"model": model, "optimizer": optimizer},
        "my_listener": lambda event: None,
    }


def _weights(ns: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": _full(v).detach().clone() for k, v in ns["model"].state_dict().items()}
    for i, (_, per_param) in enumerate(sorted(ns["optimizer"].state_dict()["state"].items())):
        for k, v in per_param.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{k}"] = _full(v).detach().clone()
    return out


def _exec(code: str, name: str, ns: dict[str, Any], folder: str) -> dict[str, Any]:
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    exec(compile(code, name, "exec"), ns)
    import unickpt

    unickpt.wait_all()
    return ns


def _run_resume(code: str, name: str, work: str) -> None:
    straight = _exec(code, name, _namespace(0, RESUME_STEPS), os.path.join(work, "a"))
    stopped = _exec(code, name, _namespace(0, STOP_AT), os.path.join(work, "b"))
    resumed = _exec(code, name, _namespace(1, RESUME_STEPS), os.path.join(work, "b"))
    for ns, want in ((straight, 0), (stopped, 0), (resumed, 200)):
        if ns.get("done") not in (want, None):
            raise AssertionError(f"load_latest gave {ns.get('done')}, expected {want}")
    ref, got = _weights(straight), _weights(resumed)
    if sorted(ref) != sorted(got):
        raise AssertionError(f"state keys differ: {sorted(ref)} vs {sorted(got)}")
    differ = [k for k in ref if not torch.equal(ref[k], got[k])]
    if differ:
        raise AssertionError(f"the resumed run differs from the uninterrupted one in {differ}")


def main(snippets_path: str, results_path: str) -> None:
    with open(snippets_path) as f:
        snippets = json.load(f)
    work = tempfile.mkdtemp(prefix="unickpt-doc-examples-")
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=0, world_size=1)
    results: dict[str, str | None] = {}
    try:
        for i, s in enumerate(snippets):
            folder = os.path.join(work, f"s{i}")
            try:
                if s["kind"] == "resume":
                    _run_resume(s["code"], s["name"], folder)
                else:
                    _exec(s["code"], s["name"], _namespace(0, RESUME_STEPS), folder)
                results[s["name"]] = None
            except BaseException:  # a broken example: report it, run the next one
                results[s["name"]] = traceback.format_exc(limit=6)
                try:
                    import unickpt

                    unickpt.wait_all()
                except BaseException:
                    pass
    finally:
        os.chdir(work)
        with open(results_path, "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
