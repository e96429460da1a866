"""Worker functions for the FSDP1 tests (spawned by harness.run_ranks).

A *spec* names a toy build: ``fsdp`` (FSDP1, flat params, FULL_SHARD, every Block wrapped),
``-orig`` (use_orig_params=True), ``-sgo`` (SHARD_GRAD_OP), ``-noshard`` (NO_SHARD), ``-sgd``
(SGD with momentum instead of AdamW), ``-warm`` (load into an already trained optimizer), or
another framework (``torch``, ``ddp``, ``fsdp2``; ``torch-sgd``). The toy uses ``ffn=101`` so
the FSDP1 flat parameters need padding at every world size tested. Several saves or loads run
in one spawn (each with fresh objects) to keep the number of process starts low.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import unickpt
import unickpt.errors
from tests.support.reference import full_state
from tests.workers.reshard_workers import loaded_report, param_groups
from unickpt.testing.toy import ToyConfig, build, train_step

STEPS_BEFORE_SAVE = 2
CFG = ToyConfig(ffn=101)


def make(spec: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, str]:
    """(model, optimizer, adapter name) for ``spec``."""
    parts = spec.split("-")
    framework = parts[0]
    kw = {}
    if framework == "fsdp":
        sharding = "SHARD_GRAD_OP" if "sgo" in parts else "NO_SHARD" if "noshard" in parts else "FULL_SHARD"
        kw = {"use_orig_params": "orig" in parts, "sharding": sharding}
    model, optim = build(framework, CFG, seed=seed, **kw)
    if "sgd" in parts:
        optim = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return model, optim, framework


def save_one(rank: int, spec: str, ckpt: str) -> dict:
    """Train, save at step 2, then go on one more step (the uninterrupted run's next loss)."""
    model, optim, framework = make(spec, 0)
    for s in range(STEPS_BEFORE_SAVE):
        train_step(model, optim, s, CFG)
    extra = {"step": STEPS_BEFORE_SAVE, "rank": rank, "note": ("tuple", 1.5, None)}
    unickpt.save(ckpt, {"model": model, "optimizer": optim, "extra_state": extra}, framework=framework).wait()
    state = full_state(model, optim)
    groups = param_groups(optim)
    next_loss = train_step(model, optim, STEPS_BEFORE_SAVE, CFG)
    return {"state": state if rank == 0 else None, "groups": groups, "next_loss": next_loss}


def load_one(rank: int, spec: str, ckpt: str, ref: dict) -> dict:
    model, optim, framework = make(spec, 1234)  # different init: everything must come from ckpt
    if "warm" in spec.split("-"):  # load into an optimizer that already has (partial) state
        train_step(model, optim, 7, CFG)
    state = {"model": model, "optimizer": optim, "extra_state": None}
    unickpt.load(ckpt, state, framework=framework)
    report = loaded_report(state, ref)
    report["loss"] = train_step(model, optim, STEPS_BEFORE_SAVE, CFG)
    return report


def save_many(rank: int, ws: int, jobs: list[tuple[str, str]]) -> list[dict]:
    return [save_one(rank, spec, ckpt) for spec, ckpt in jobs]


def load_many(rank: int, ws: int, jobs: list[tuple[str, str, dict]]) -> list[dict]:
    return [load_one(rank, spec, ckpt, ref) for spec, ckpt, ref in jobs]


_COLLECTIVES = (
    "all_gather_into_tensor",
    "all_gather",
    "_all_gather_base",
    "broadcast",
    "all_reduce",
    "reduce_scatter_tensor",
    "all_gather_object",
    "broadcast_object_list",
    "barrier",
    "gather",
    "scatter",
    "send",
    "recv",
    "all_to_all",
)


def no_collective_save_view(rank: int, ws: int, specs: list[str]) -> list[dict]:
    """``save_view`` with every collective patched to raise: it must still describe the state,
    with zero-copy views into the flat parameter, no padding, and boxes matching the full state."""
    import torch.distributed.distributed_c10d as c10d

    from unickpt.frameworks import get_framework
    from unickpt.frameworks.fsdp1 import flat_layouts

    out = []
    for spec in specs:
        model, optim, _ = make(spec, 0)
        train_step(model, optim, 0, CFG)
        ref = full_state(model, optim)  # collective: before patching
        state = {"model": model, "optimizer": optim}
        adapter = get_framework("auto", state)
        saved = {name: (getattr(dist, name, None), getattr(c10d, name, None)) for name in _COLLECTIVES}
        calls: list[str] = []

        def boom(*a, _name: str = "", _calls: list[str] = calls, **k):
            _calls.append(_name)
            raise RuntimeError(f"collective {_name} called during save_view")

        try:
            for name in _COLLECTIVES:
                for mod in (dist, c10d):
                    if getattr(mod, name, None) is not None:
                        setattr(mod, name, lambda *a, _n=name, **k: boom(*a, _name=_n, **k))
            view = adapter.save_view(state)
        finally:
            for name, (d, c) in saved.items():
                if d is not None:
                    setattr(dist, name, d)
                if c is not None:
                    setattr(c10d, name, c)
        storages = {lay.flat_param.untyped_storage().data_ptr() for lay in flat_layouts(model)}
        model_items = [i for i in view.items if i.spec.fqn.startswith("model.")]
        wrong = []
        for it in view.items:
            full = ref[it.spec.fqn]
            box = tuple(slice(o, o + n) for o, n in zip(it.spec.offsets, it.spec.lengths))
            if not torch.equal(full[box], it.tensor):
                wrong.append(it.spec.fqn)
        local = sum(
            info.numel_in_shard or 0 for lay in flat_layouts(model) for info in lay.flat_param._shard_param_infos
        )
        refused = ""
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            try:
                adapter.save_view(state)
            except unickpt.errors.FrameworkError as e:  # unsharded: must be refused
                refused = str(e)
        out.append(
            {
                "adapter": adapter.name,
                "refused": refused,
                "calls": calls,
                "n_items": len(view.items),
                "zero_copy": all(i.tensor.untyped_storage().data_ptr() in storages for i in model_items),
                "model_numel": sum(i.tensor.numel() for i in model_items),
                "local_numel": local,
                "padded_numel": sum(lay.local.numel() for lay in flat_layouts(model)),
                "wrong": wrong,
                "optim_keys": sorted({i.spec.fqn for i in view.items if i.spec.fqn.startswith("optimizer.")}),
                "has_groups": "optimizer" in view.objects,
            }
        )
    return out


class TiedBN(torch.nn.Module):
    """Tied embedding/head weights, BatchNorm buffers, a nested FSDP unit and an ignored module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.body = torch.nn.Linear(6, 7)
        self.extra = torch.nn.Linear(7, 3)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.bn(self.embed(tokens))
        return self.head(h), self.extra(self.body(h))


def tied_bn_model(seed: int) -> TiedBN:
    """The model with seeded parameters and BatchNorm statistics."""
    torch.manual_seed(seed)
    model = TiedBN()
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.randn(6))
        model.bn.running_var.copy_(torch.rand(6))
        model.bn.num_batches_tracked.fill_(seed + 3)
    return model


def tied_bn_save(rank: int, ws: int, ckpt: str, use_orig_params: bool) -> None:
    from functools import partial

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    plain = tied_bn_model(0)
    policy = partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m is plain.body)
    plain.eval()
    model = FullyShardedDataParallel(
        plain,
        auto_wrap_policy=policy,
        ignored_modules=[plain.extra],
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )
    model(torch.arange(10) % 11)  # lazy init; eval mode: statistics unchanged
    unickpt.save(ckpt, {"model": model}, framework="auto").wait()


def save_view_and_tied_saves(rank: int, ws: int, specs: list[str], tied: list[list]) -> list[dict]:
    """One spawn for two checks: ``no_collective_save_view(specs)`` (its result), then
    ``tied_bn_save`` for each ``[ckpt, use_orig_params]`` of ``tied``."""
    out = no_collective_save_view(rank, ws, specs)
    for ckpt, use_orig_params in tied:
        tied_bn_save(rank, ws, ckpt, use_orig_params)
    return out


def load_expecting_error(rank: int, ws: int, specs: list[str], ckpt: str) -> list[str]:
    """Load ``ckpt`` into each of ``specs``; the error messages ("" where it loaded)."""
    out = []
    for spec in specs:
        model, optim, framework = make(spec, 1234)
        try:
            unickpt.load(ckpt, {"model": model, "optimizer": optim}, framework=framework)
            out.append("")
        except unickpt.errors.CheckpointError as e:
            out.append(str(e))
    return out


def async_save_while_training(rank: int, world_size: int, specs: list[str], root: str) -> dict:
    """For each spec: train, save asynchronously with the background copy held back, keep
    training at once (the optimizer step must wait for the copy), then load into fresh objects:
    the checkpoint must be the state at the save call, bit for bit."""
    import threading
    import time

    from unickpt.engine.save import staging

    real = staging._copy_entries

    def held(*args, **kwargs):  # the snapshot thread starts late: training overlaps it
        if threading.current_thread().name.startswith("unickpt-snapshot"):
            time.sleep(0.2)
        return real(*args, **kwargs)

    staging._copy_entries = held
    out = {}
    for spec in specs:
        model, optim, framework = make(spec, 0)
        for s in range(STEPS_BEFORE_SAVE):
            train_step(model, optim, s, CFG)
        ref = {"state": full_state(model, optim), "groups": param_groups(optim)}
        extra = {"step": STEPS_BEFORE_SAVE, "rank": rank, "note": ("tuple", 1.5, None)}
        path = f"{root}/{spec}"
        h = unickpt.save(
            path, {"model": model, "optimizer": optim, "extra_state": extra}, framework=framework, async_save=True
        )
        waited = []
        for s in range(2):
            train_step(model, optim, STEPS_BEFORE_SAVE + s, CFG)
            waited.append(h._snapshot is not None and h._snapshot.done())
        h.wait()
        model2, optim2, _ = make(spec, 1234)
        state = {"model": model2, "optimizer": optim2, "extra_state": None}
        unickpt.load(path, state, framework=framework)
        report = loaded_report(state, ref)
        report["step_waited_for_copy"] = waited
        out[spec] = report
    return out
