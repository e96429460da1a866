"""Worker functions for the resume tests (spawned by harness.run_ranks): rollback into live
objects, step-0 checkpoints and parameters without optimizer state, pipeline-style jobs whose
ranks hold different parameters, DDP buffers, refused loads.

References are always taken with torch's own APIs (``support.reference.full_state``:
``full_tensor()``, ``state_dict()``, FSDP1's full state dicts), never with unickpt; every case returns plain values
that the test process asserts on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import unickpt
import unickpt.errors
from tests.support.reference import full_state
from tests.workers.fsdp1_workers import CFG, make
from tests.workers.reshard_workers import param_groups
from unickpt.options import ReadOptions, RestoreOptions
from unickpt.testing.toy import ToyConfig, batch, build, train_step


def _make(spec: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, str, ToyConfig]:
    """``fsdp1_workers.make``, but tensor parallelism with the default toy (TP needs even splits)."""
    if spec == "dtensor":
        return (*build("dtensor", seed=seed), "dtensor", ToyConfig())
    return (*make(spec, seed), CFG)


def _backward_only(model: nn.Module, step: int, c: ToyConfig) -> None:
    """Forward and backward of the toy without an optimizer step: gradients are left set."""
    tokens = batch(step, c)
    logits = model(tokens[:, :-1])
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    F.cross_entropy(logits.reshape(-1, c.vocab), tokens[:, 1:].reshape(-1)).backward()


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    out = []
    for p in model.parameters():
        g = p.grad
        if g is not None and hasattr(g, "to_local"):
            g = g.to_local()
        out.append(None if g is None else g.detach().clone())
    return out


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    keys = sorted(set(got) | set(want))
    return [k for k in keys if k not in got or k not in want or not torch.equal(got[k], want[k])]


def rollback(rank: int, ws: int, specs: list[str], root: str) -> dict[str, dict]:
    """Train, save, train on (losses of the uninterrupted run), leave gradients set and change a
    hyper-parameter, load the old checkpoint into the same objects, train again."""
    out = {}
    for spec in specs:
        model, optim, framework, c = _make(spec, 0)
        for s in range(2):
            train_step(model, optim, s, c)
        path = f"{root}/{spec}"
        unickpt.save(path, {"model": model, "optimizer": optim}, framework=framework).wait()
        at_save, groups = full_state(model, optim), param_groups(optim)
        uninterrupted = [train_step(model, optim, s, c) for s in (2, 3)]
        train_step(model, optim, 4, c)
        _backward_only(model, 5, c)  # gradients left set, as in a job rolled back mid-step
        optim.param_groups[0]["lr"] = 0.5
        grads = _grads(model)
        error = ""
        try:
            unickpt.load(path, {"model": model, "optimizer": optim}, framework=framework)
        except unickpt.errors.CheckpointError as e:
            error = f"{type(e).__name__}: {e}"
        report: dict[str, Any] = {"error": error}
        if not error:
            after = _grads(model)
            report["grads_untouched"] = len(after) == len(grads) and all(
                (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for a, b in zip(after, grads)
            )
            report["not_bit_exact"] = _diff(full_state(model, optim), at_save)
            report["groups_equal"] = param_groups(optim) == groups
            optim.zero_grad(set_to_none=True)
            report["losses"] = [train_step(model, optim, s, c) for s in (2, 3)]
            report["uninterrupted"] = uninterrupted
        out[spec] = report
    return out


# ----------------------------------------------------------------------------- step 0, unused params


class Branchy(nn.Module):
    """Two used layers and a branch that never runs (its parameters never get a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.used1 = nn.Linear(6, 10)
        self.used2 = nn.Linear(10, 3)
        self.unused = nn.Linear(6, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used2(torch.tanh(self.used1(x)))


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    raise ValueError(kind)


def build_branchy(framework: str, kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, str]:
    """``framework``: torch, fsdp2, fsdp (FSDP1 flat, ``unused`` its own unit) or fsdp-orig."""
    torch.manual_seed(seed)
    model: nn.Module = Branchy()
    adapter = framework
    if framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.used1)
        fully_shard(model.unused)
        fully_shard(model)
    elif framework.startswith("fsdp"):
        from functools import partial

        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        inner = model
        policy = partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m is inner.unused)
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=policy, use_orig_params=framework == "fsdp-orig", device_id=torch.device("cpu")
        )
        adapter = "fsdp"
    return model, make_optimizer(kind, model.parameters()), adapter


def branchy_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    out = model(x)
    loss = F.mse_loss(out.full_tensor() if hasattr(out, "full_tensor") else out, y)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def absent_state(rank: int, ws: int, cases: list[tuple[str, str]], root: str) -> dict[str, dict]:
    """For each (framework, optimizer): a step-0 checkpoint resumed strictly into fresh objects
    and rolled back into trained ones; a checkpoint of a model with an unused branch resumed
    strictly into fresh objects. Returns what differs from the uninterrupted run."""
    out = {}
    for framework, kind in cases:
        name = f"{framework}-{kind}"
        rep: dict[str, Any] = {}
        # step 0: nothing trained yet
        model, optim, adapter = build_branchy(framework, kind, 0)
        p0 = f"{root}/{name}-step0"
        unickpt.save(p0, {"model": model, "optimizer": optim}, framework=adapter).wait()
        ref_losses = [branchy_step(model, optim, s) for s in range(2)]
        ref_state = full_state(model, optim)
        fresh, fopt, _ = build_branchy(framework, kind, 7)
        try:
            unickpt.load(p0, {"model": fresh, "optimizer": fopt}, framework=adapter)
            rep["step0_state_empty"] = len(fopt.state) == 0
            rep["step0_losses"] = [branchy_step(fresh, fopt, s) for s in range(2)] == ref_losses
            rep["step0_after"] = _diff(full_state(fresh, fopt), ref_state)
            # rollback of the trained optimizer to step 0: its state goes away
            unickpt.load(p0, {"model": model, "optimizer": optim}, framework=adapter)
            rep["rollback_state_empty"] = len(optim.state) == 0
            rep["rollback_losses"] = [branchy_step(model, optim, s) for s in range(2)] == ref_losses
        except unickpt.errors.CheckpointError as e:
            rep["step0_error"] = f"{type(e).__name__}: {e}"
        # unused branch: trained, its parameters have no state
        model, optim, adapter = build_branchy(framework, kind, 1)
        for s in range(2):
            branchy_step(model, optim, s)
        p1 = f"{root}/{name}-unused"
        unickpt.save(p1, {"model": model, "optimizer": optim}, framework=adapter).wait()
        at_save = full_state(model, optim)
        rep["unused_has_no_state"] = not any(k.startswith("optimizer.state.unused.") for k in at_save)
        nxt = branchy_step(model, optim, 2)
        after_next = full_state(model, optim)
        fresh, fopt, _ = build_branchy(framework, kind, 8)
        try:
            unickpt.load(p1, {"model": fresh, "optimizer": fopt}, framework=adapter)
            rep["unused_loaded"] = _diff(full_state(fresh, fopt), at_save)
            rep["unused_next_loss"] = branchy_step(fresh, fopt, 2) == nxt
            rep["unused_after_next"] = _diff(full_state(fresh, fopt), after_next)
        except unickpt.errors.CheckpointError as e:
            rep["unused_error"] = f"{type(e).__name__}: {e}"
        out[name] = rep
    return out


# ----------------------------------------------------------------------------- pipeline stages

# each rank ("stage") holds different layers with its own hyper-parameters; stage 0 has two groups
STAGE_LAYERS = {0: ("0", "1"), 1: ("2", "3")}
STAGE_GROUPS: dict[int, list[dict[str, Any]]] = {
    0: [
        {"layers": ("0",), "lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1},
        {"layers": ("1",), "lr": 2e-2, "betas": (0.8, 0.9), "weight_decay": 0.0},
    ],
    1: [{"layers": ("2", "3"), "lr": 3e-3, "betas": (0.85, 0.95), "weight_decay": 0.05}],
}


class Stage(nn.Module):
    def __init__(self, layers: tuple[str, ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({i: nn.Linear(5, 5) for i in layers})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def stage_optimizer(model: Stage, groups: list[dict[str, Any]], defaults: bool) -> torch.optim.Optimizer:
    """AdamW with one param group per entry of ``groups``; ``defaults``: torch's default
    hyper-parameters instead of the entry's (the load must bring the saved ones)."""
    pg = []
    for g in groups:
        params = [p for i in g["layers"] for p in model.layers[i].parameters()]
        hyper = {} if defaults else {k: v for k, v in g.items() if k != "layers"}
        pg.append({"params": params, **hyper})
    return torch.optim.AdamW(pg)


def stage_step(model: Stage, optim: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(900 + step)
    loss = model(torch.randn(4, 5, generator=g)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def torch_optimizer_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's own ``optimizer.state_dict()``, with parameter indices replaced by fqns."""
    sd = optim.state_dict()
    by_index = {}
    index = 0
    ids = {id(p): n for n, p in model.named_parameters()}
    for g in optim.param_groups:
        for p in g["params"]:
            by_index[index] = ids[id(p)]
            index += 1
    state = {by_index[i]: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [by_index[i] for i in g["params"]]}
        for g in sd["param_groups"]
    ]
    return {"state": state, "groups": groups}


def pipeline_stages(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Stage ``rank`` trains its layers, saves, and resumes (same layout, strict) into fresh
    objects built with default hyper-parameters; ranks that disagree on the hyper-parameters of
    one parameter are refused at save."""
    torch.manual_seed(rank)
    model = Stage(STAGE_LAYERS[rank])
    optim = stage_optimizer(model, STAGE_GROUPS[rank], defaults=False)
    for s in range(2):
        stage_step(model, optim, s)
    path = f"{root}/pipeline"
    unickpt.save(path, {"model": model, "optimizer": optim}, framework="torch").wait()
    ref = torch_optimizer_state(model, optim)
    ref_model = {k: v.clone() for k, v in model.state_dict().items()}
    nxt = stage_step(model, optim, 2)
    torch.manual_seed(100 + rank)
    fresh = Stage(STAGE_LAYERS[rank])
    fopt = stage_optimizer(fresh, STAGE_GROUPS[rank], defaults=True)
    out: dict[str, Any] = {"ref": ref, "ref_model": ref_model}
    try:
        unickpt.load(path, {"model": fresh, "optimizer": fopt}, framework="torch")
        out["got"] = torch_optimizer_state(fresh, fopt)
        out["model_equal"] = all(torch.equal(v, ref_model[k]) for k, v in fresh.state_dict().items())
        out["next_loss_equal"] = stage_step(fresh, fopt, 2) == nxt
    except unickpt.errors.CheckpointError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    # the same parameters with different hyper-parameters on the two ranks: refused at save
    torch.manual_seed(0)
    same = Stage(("0",))
    sopt = torch.optim.AdamW(same.parameters(), lr=1e-3 * (rank + 1))
    stage_step(same, sopt, 0)
    try:
        unickpt.save(f"{root}/disagree", {"model": same, "optimizer": sopt}, framework="torch").wait()
        out["disagree_error"] = ""
    except unickpt.errors.CheckpointError as e:
        out["disagree_error"] = f"{type(e).__name__}: {e}"
    return out


# ----------------------------------------------------------------------------- DDP buffers


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _bn_data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + 31 * rank + step)  # every rank its own batch
    return torch.randn(16, 4, generator=g) * (1 + rank), torch.randn(16, 1, generator=g)


def _bn_step(model: nn.Module, optim: torch.optim.Optimizer, rank: int, step: int) -> tuple[float, float]:
    """One DDP step (train mode: BatchNorm updates this rank's running statistics), then the
    evaluation loss of this rank's module on a fixed batch (uses the running statistics)."""
    x, y = _bn_data(rank, step)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    module = model.module
    module.eval()
    with torch.no_grad():
        ex, ey = _bn_data(99, 0)
        ev = float(F.mse_loss(module(ex), ey))
    module.train()
    return float(loss.detach()), ev


def ddp_buffers(rank: int, ws: int, root: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = DistributedDataParallel(BNNet())  # broadcast_buffers=True: rank 0's buffers rule
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    model, optim = build(0)
    for s in range(2):
        _bn_step(model, optim, rank, s)
    path = f"{root}/ddp-bn"
    unickpt.save(path, {"model": model, "optimizer": optim}, framework="ddp").wait()
    buffers = {k: v.clone() for k, v in model.module.state_dict().items() if k.startswith("bn.running")}
    uninterrupted = [_bn_step(model, optim, rank, s) for s in (2, 3)]
    fresh, fopt = build(5)
    unickpt.load(path, {"model": fresh, "optimizer": fopt}, framework="ddp")
    loaded = {k: v.clone() for k, v in fresh.module.state_dict().items() if k.startswith("bn.running")}
    resumed = [_bn_step(fresh, fopt, rank, s) for s in (2, 3)]
    return {"buffers": buffers, "loaded": loaded, "uninterrupted": uninterrupted, "resumed": resumed}


# ----------------------------------------------------------------------------- refused loads


def refused_flat_step(rank: int, ws: int, ckpt: str) -> dict[str, Any]:
    """Load a checkpoint whose per-parameter steps differ into an FSDP1 flat-parameter model
    with a trained optimizer and into one with a fresh optimizer: refused, nothing changed."""
    out: dict[str, Any] = {}
    for label, trained in (("trained", True), ("fresh", False)):
        model, optim, framework = make("fsdp", 1234)
        if trained:
            train_step(model, optim, 7, CFG)
        before = full_state(model, optim)
        n_state = len(optim.state)
        try:
            unickpt.load(ckpt, {"model": model, "optimizer": optim}, framework=framework)
            out[label] = {"error": ""}
        except unickpt.errors.CheckpointError as e:
            out[label] = {
                "error": str(e),
                "changed": _diff(full_state(model, optim), before),
                "state_entries": (n_state, len(optim.state)),
            }
    return out


def cast_load(rank: int, ws: int, ckpt: str) -> dict[str, Any]:
    """Load an fp32 checkpoint into a bf16 DDP replica with cast_dtypes (reads forwarded
    between the ranks), returning the loaded tensors."""
    from torch.nn.parallel import DistributedDataParallel

    from unickpt.testing.toy import ToyTransformer

    torch.manual_seed(3)
    model = DistributedDataParallel(ToyTransformer(CFG).to(torch.bfloat16))
    unickpt.load(
        ckpt,
        {"model": model},
        framework="ddp",
        options=unickpt.LoadOptions(io=ReadOptions(dedup_reads=True), restore=RestoreOptions(cast_dtypes=True)),
    )
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def world(rank: int, ws: int) -> int:
    return dist.get_world_size()


def pipelining_stages(rank: int, ws: int, root: str) -> dict[str, Any]:
    """``torch.distributed.pipelining``: a 4-layer model split into 2 stages run by GPipe, each
    stage with its own AdamW hyper-parameters. Train 2 steps, save, train one more (the
    uninterrupted loss); resume strictly into fresh stages built with default hyper-parameters."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)) for _ in range(3)]
    hyper = {0: {"lr": 1e-2, "betas": (0.9, 0.99)}, 1: {"lr": 4e-3, "betas": (0.7, 0.95), "weight_decay": 0.2}}

    def build(seed: int, defaults: bool) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(seed)
        full = nn.Sequential(*[nn.Linear(5, 5) for _ in range(4)])
        part = nn.Sequential()
        for i in STAGE_LAYERS[rank]:
            part.add_module(i, full[int(i)])
        optim = torch.optim.AdamW(part.parameters(), **({} if defaults else hyper[rank]))
        stage = PipelineStage(part, rank, ws, torch.device("cpu"))
        return part, optim, ScheduleGPipe(stage, n_microbatches=2, loss_fn=F.mse_loss)

    def step(part: nn.Module, optim: torch.optim.Optimizer, schedule: Any, s: int) -> float:
        x, y = data[s]
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        optim.step()
        optim.zero_grad(set_to_none=True)
        return float(sum(loss.detach() for loss in losses)) if losses else 0.0

    part, optim, schedule = build(0, defaults=False)
    for s in range(2):
        step(part, optim, schedule, s)
    path = f"{root}/pipelining"
    unickpt.save(path, {"model": part, "optimizer": optim}, framework="torch").wait()
    ref = torch_optimizer_state(part, optim)
    nxt = step(part, optim, schedule, 2)
    fresh, fopt, fschedule = build(9, defaults=True)
    unickpt.load(path, {"model": fresh, "optimizer": fopt}, framework="torch")
    got = torch_optimizer_state(fresh, fopt)
    return {
        "groups_equal": got["groups"] == ref["groups"],
        "lr": fopt.param_groups[0]["lr"],
        "state_equal": set(got["state"]) == set(ref["state"])
        and all(torch.equal(got["state"][f][k], v) for f, st in ref["state"].items() for k, v in st.items()),
        "next_loss_equal": step(fresh, fopt, fschedule, 2) == nxt,
    }
