"""Runs documentation code examples in one process (``tests/unit/test_doc_examples.py`` starts it).

``python doc_examples_worker.py SNIPPETS.json RESULTS.json``: SNIPPETS is a list of
``{"name", "code", "kind"}``; every snippet runs with ``exec`` in a fresh namespace that defines
the names the examples use (a tiny FSDP2 model on a one-rank gloo group, its optimizer,
``state``, ``step``, ``steps``, ``train_step(step)``, ``actor_group``, ``actor_state``,
``my_listener``; for the "What can be in state" example two FSDP2 model parts, an optimizer and
a scheduler each, a gradient scaler, an EMA module, a train-state and an RNG ``Stateful``, a
stateful data loader, ``path``), in a fresh working folder. ``kind == "resume"``: a training-loop example with a
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


class _TrainState:
    """A user's own ``Stateful``: an int and a tensor."""

    def __init__(self) -> None:
        self.step, self.tokens = 7, torch.arange(3)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.tokens = sd["step"], sd["tokens"]


class _RngTracker:
    """A per-rank ``Stateful``."""

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd["cpu"])


def _parts() -> dict[str, Any]:
    """The names the "What can be in state" example uses."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    stage0, stage1 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
    stage1 = torch.nn.Sequential(stage1)  # parts name their parameters apart (weight vs 0.weight)
    for part in (stage0, stage1):
        fully_shard(part)
    opt0, opt1 = torch.optim.AdamW(stage0.parameters(), lr=1e-2), torch.optim.AdamW(stage1.parameters(), lr=1e-3)
    return {
        "stage0": stage0,
        "stage1": stage1,
        "opt0": opt0,
        "opt1": opt1,
        "sched0": torch.optim.lr_scheduler.CosineAnnealingLR(opt0, 10),
        "sched1": torch.optim.lr_scheduler.CosineAnnealingLR(opt1, 10),
        "grad_scaler": torch.amp.GradScaler("cpu"),
        "ema_model": torch.nn.Linear(6, 8),
        "train_state": _TrainState(),
        "rng_tracker": _RngTracker(),
        "loader": StatefulDataLoader(list(range(10)), batch_size=2),
        "path": "ckpts/whole_state",
    }


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
        **_parts(),
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
