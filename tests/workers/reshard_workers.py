"""Worker functions for the resharding tests (spawned by harness.run_ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import unickpt
from tests.support.reference import full_state
from unickpt.testing.toy import build, train_step

STEPS_BEFORE_SAVE = 2


def save_phase(rank: int, ws: int, framework: str, ckpt: str) -> dict:
    """Train, save at step 2, then go on one more step (the uninterrupted run's next loss)."""
    model, optim = build(framework, seed=0)
    for s in range(STEPS_BEFORE_SAVE):
        train_step(model, optim, s)
    extra = {"step": STEPS_BEFORE_SAVE, "rank": rank, "rng": unickpt.rng_state(), "note": ("tuple", 1.5, None)}
    unickpt.save(
        ckpt,
        {"model": model, "optimizer": optim, "extra_state": extra},
        framework=framework.replace("fsdp2+tp", "fsdp2"),
    ).wait()
    state = full_state(model, optim)
    groups = param_groups(optim)
    next_loss = train_step(model, optim, STEPS_BEFORE_SAVE)
    return {"state": state if rank == 0 else None, "groups": groups, "next_loss": next_loss}


def load_phase(rank: int, ws: int, framework: str, ckpt: str, ref: dict) -> dict:
    model, optim = build(framework, seed=1234)  # different init: everything must come from ckpt
    state = {"model": model, "optimizer": optim, "extra_state": None}
    unickpt.load(ckpt, state, framework=framework)
    report = loaded_report(state, ref)
    report["loss"] = train_step(model, optim, STEPS_BEFORE_SAVE)
    report["world"] = dist.get_world_size() if dist.is_initialized() else 1
    return report


def param_groups(optim: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's param groups without their parameter lists (hyperparameters only)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]


def loaded_report(state: dict, ref: dict) -> dict:
    """What a load restored into ``state`` (model, optimizer, extra_state) against the saved
    reference: tensors that differ, are missing or extra, param groups, extra state."""
    model, optim = state["model"], state["optimizer"]
    got = full_state(model, optim)
    extra = state["extra_state"]
    return {
        "mismatched": [k for k in ref["state"] if not torch.equal(got.get(k, torch.empty(0)), ref["state"][k])],
        "missing": sorted(set(ref["state"]) - set(got)),
        "extra": sorted(set(got) - set(ref["state"])),
        "groups_equal": param_groups(optim) == ref["groups"],
        "extra_state": {"step": extra["step"], "rank": extra["rank"], "note": extra["note"]},
    }


def check(results: list[dict], ref: dict, saved_ws: int) -> None:
    for rank, r in enumerate(results):
        assert not r["missing"] and not r["extra"], (r["missing"], r["extra"])
        assert not r["mismatched"], f"rank {rank}: not bit-exact: {r['mismatched'][:10]}"
        assert r["groups_equal"], f"rank {rank}: param_groups differ"
        assert r["loss"] == ref["next_loss"], f"rank {rank}: loss {r['loss']} != {ref['next_loss']}"
        assert r["extra_state"]["step"] == STEPS_BEFORE_SAVE
        assert r["extra_state"]["rank"] == rank % saved_ws
        assert r["extra_state"]["note"] == ("tuple", 1.5, None)


def save_many(rank: int, ws: int, steps: list[list]) -> list[dict]:
    """``save_phase`` for each ``[framework, ckpt]`` in turn, in one spawned job."""
    return [save_phase(rank, ws, framework, ckpt) for framework, ckpt in steps]


def load_many(rank: int, ws: int, steps: list[list]) -> list[dict]:
    """``load_phase`` for each ``[framework, ckpt, ref]`` in turn, in one spawned job."""
    return [load_phase(rank, ws, framework, ckpt, ref) for framework, ckpt, ref in steps]
