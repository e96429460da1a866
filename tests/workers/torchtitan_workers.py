"""Rank functions of tests/integration/integrations/test_torchtitan.py: torchtitan's real llama3 debug model
(two layers of its ``debugmodel`` config), its ``OptimizersContainer`` (AdamW, two param groups),
``LRSchedulersContainer`` (warmup + linear decay) and ``ParallelAwareDataloader``, driven through
``UnickptCheckpointManager`` in the order torchtitan's ``Trainer`` calls it: ``load()`` once,
then per step: batch, backward, ``maybe_wait_for_staging()``, optimizer and scheduler step,
``save(step)``. Gradients are made without the attention forward (FlexAttention has no backward
on CPU): ``loss = sum(c_step * p**2)``; the forward (no grad) gives the loss compared across runs.
The train state is torchtitan's ``Trainer`` itself, as its trainer passes it
(``states={"train_state": self}``): its own ``state_dict`` / ``load_state_dict`` (``step``,
``ntokens_seen``), on an instance made without ``Trainer.__init__``, which builds the whole job
on a CUDA device (tests/integration/integrations/test_torchtitan_trainer.py runs that one)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset

SAVE_STEPS = 6  # saves at 2, 4, 6 (interval 2, keep_latest_k 2: step-2 is purged)
VOCAB = 2048
SEQ = 16


class TokenStream(IterableDataset):
    """The user's dataset: a deterministic token stream per DP rank."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank

    def __iter__(self):
        g = torch.Generator().manual_seed(1000 + self.dp_rank)
        while True:
            yield torch.randint(0, VOCAB, (SEQ,), generator=g)


def train_state() -> Any:
    """torchtitan's ``Trainer`` as its own train state: ``step`` and ``ntokens_seen`` set as
    ``Trainer.__init__`` sets them, nothing else built (``__init__`` needs a CUDA device)."""
    from torchtitan.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.step = 0
    trainer.ntokens_seen = 0
    return trainer


def _rank_ws() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build(root: str, **config: Any) -> dict[str, Any]:
    """The trainer's objects, built as torchtitan builds them, and the manager."""
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.models.llama3 import model_registry

    rank, ws = _rank_ws()
    spec = model_registry("debugmodel", attn_backend="flex")
    spec.model.layers = spec.model.layers[:2]
    with torch.device("meta"):
        model = spec.model.build()
    if ws > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers:
            fully_shard(layer)
        fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_states()
    optimizers = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(pattern=r"norm", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.1}),
        ],
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)
    dataloader = ParallelAwareDataloader(TokenStream(rank), dp_rank=rank, dp_world_size=ws, batch_size=2)
    t = {
        "model": model, "optimizers": optimizers, "lr_schedulers": lr_schedulers, "dataloader": dataloader,
        "data": iter(dataloader), "train_state": train_state(), "model_config": spec.model,
    }  # fmt: skip
    t["manager"] = manager_for(t, root, **config)
    return t


def sd_adapter(t: dict[str, Any]) -> Any:
    """torchtitan's llama3 state-dict adapter for the model's config (no HF assets)."""
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return Llama3StateDictAdapter(t["model_config"], None)


def manager_for(t: dict[str, Any], root: str, manager: Any = None, **config: Any) -> Any:
    """``config.checkpoint.build(...)`` as torchtitan's ``Trainer.__init__`` calls it;
    ``manager``: the class (default ``UnickptCheckpointManager``; torchtitan's own DCP
    ``CheckpointManager`` for a comparison)."""
    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    manager = manager or UnickptCheckpointManager
    config.setdefault("initial_load_model_only", "initial_load_path" in config)
    return manager.Config(enable=True, **config).build(
        dataloader=t["dataloader"],
        model_parts=[t["model"]],
        optimizers=t["optimizers"],
        lr_schedulers=t["lr_schedulers"],
        states={"train_state": t["train_state"]},
        sd_adapter=sd_adapter(t) if config.get("last_save_in_hf") or config.get("initial_load_in_hf") else None,
        base_folder=root,
    )


def train_step(t: dict[str, Any]) -> None:
    """One step in the trainer's call order (save included)."""
    ts = t["train_state"]
    ts.step += 1
    batch = next(t["data"])
    ts.ntokens_seen += batch.numel()
    t["optimizers"].zero_grad()
    c = 0.01 * ts.step + float(batch[0, 0]) / VOCAB
    loss = sum((c * p.float() ** 2).sum() for p in t["model"].parameters())
    loss.backward()
    t["manager"].maybe_wait_for_staging()
    t["optimizers"].step()
    t["lr_schedulers"].step()
    t["manager"].save(ts.step)


def _full(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (x.full_tensor() if isinstance(x, DTensor) else x).detach().clone()


def forward_loss(t: dict[str, Any]) -> float:
    """The model's loss on fixed tokens (no grad; same on every rank)."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).repeat(2, 1)
    model = t["model"]
    with torch.no_grad():
        logits = model(tokens, positions=pos, attention_masks=model.get_attention_masks(positions=pos))
        return float(nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()))


def snapshot(t: dict[str, Any]) -> dict[str, Any]:
    """Full values (collective for DTensors): parameters, optimizer state and group lrs by
    parameter name, schedulers, train state."""
    model = t["model"]
    names = {id(p): n for n, p in model.named_parameters()}
    inner = t["optimizers"].optimizers
    return {
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "optim": {f"{names[id(p)]}.{k}": _full(v) for o in inner for p, st in o.state.items() for k, v in st.items()},
        "lrs": {names[id(p)]: g["lr"] for o in inner for g in o.param_groups for p in g["params"]},
        "sched": [(s.last_epoch, [float(x) for x in s.get_last_lr()]) for s in t["lr_schedulers"].schedulers],
        "train_state": t["train_state"].state_dict(),
    }


def save_ws2(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Train 6 steps with async saves at 2, 4, 6 and keep the state at step 6; in the same
    processes a fresh set of objects resumed at ws=2 (dataloader included); a last-step
    model-only save in another folder."""
    del ws
    t = build(root, interval=2, keep_latest_k=2, async_mode="async")
    out: dict[str, Any] = {"fresh_load": t["manager"].load()}
    for _ in range(SAVE_STEPS):
        train_step(t)
    out["saved"] = snapshot(t)
    out["next_batch"] = next(t["data"]).clone()
    t["manager"].maybe_wait_for_saving()
    t["manager"].close()
    out["folders"] = sorted(os.listdir(os.path.join(root, "checkpoint"))) if rank == 0 else []
    t2 = build(root, interval=2, keep_latest_k=2)
    t2["manager"].load()
    t2["data"] = iter(t2["dataloader"])  # the trainer makes its data iterator after the load
    out["resumed_same_ws"] = snapshot(t2)
    out["resumed_next_batch"] = next(t2["data"]).clone()
    t2["manager"].close()
    final = manager_for(t, root, folder="final", interval=1000, last_save_model_only=True)
    final.save(SAVE_STEPS + 1, last_step=True)
    final.close()
    hf = manager_for(t, root, folder="final_hf", interval=1000, last_save_in_hf=True, export_dtype="bfloat16")
    hf.save(SAVE_STEPS + 1, last_step=True)
    hf.close()
    out["kept"] = retention_after_last_step(t, root)
    out["saved_loss"] = forward_loss(t)  # last: a state_dict() after it failed in FSDP2 (CPU)
    out["final_files"] = sorted(os.listdir(os.path.join(root, "final"))) if rank == 0 else []
    return out


def retention_after_last_step(t: dict[str, Any], root: str) -> dict[str, list[str]]:
    """torchtitan's DCP ``CheckpointManager`` and ``UnickptCheckpointManager`` driven alike
    (interval 1, keep_latest_k 2): saves at steps 1-3, then ``save(4, last_step=True)``, model-only
    in bfloat16 or full; the ``step-N`` folders each leaves (rank 0; the others ``[]``), by
    ``keep_<manager>_<model|full>`` folder. No training between the saves: every save holds the
    state of ``t`` (the model as ``snapshot`` saw it at the end of ``save_ws2``'s run)."""
    from torchtitan.components.checkpointer import CheckpointManager

    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    kept: dict[str, list[str]] = {}
    for name, cls in (("unickpt", UnickptCheckpointManager), ("torchtitan", CheckpointManager)):
        for model_only in (True, False):
            folder = f"keep_{name}_{'model' if model_only else 'full'}"
            m = manager_for(
                t, root, cls, folder=folder, interval=1, keep_latest_k=2,
                last_save_model_only=model_only, export_dtype="bfloat16",
            )  # fmt: skip
            for step in (1, 2, 3):
                m.save(step)
            m.save(4, last_step=True)
            m.close()  # torchtitan's: joins its purge thread (its deletions are done)
            dist.barrier()
            kept[folder] = sorted(os.listdir(os.path.join(root, folder))) if dist.get_rank() == 0 else []
    return kept


def load_ws3(rank: int, ws: int, root: str) -> dict[str, Any]:
    """At ws=3: the default refuses the per-rank dataloader state of ws=2 before anything changed;
    with ``dataloader_on_resize="skip"`` the latest checkpoint loads; then one more step."""
    del rank, ws
    from unickpt.errors import LoaderStateError

    t = build(root)
    before = snapshot(t)
    out: dict[str, Any] = {}
    try:
        t["manager"].load()
        out["refused"] = ""
    except LoaderStateError as e:
        out["refused"] = str(e)
    out["unchanged"] = all(torch.equal(before["params"][k], v) for k, v in snapshot(t)["params"].items())
    t["manager"].close()
    t = build(root, dataloader_on_resize="skip", load_only=True)
    out["loaded_flag"] = t["manager"].load()
    out["loaded"] = snapshot(t)
    t["manager"].close()
    # the ws=2 HF export (bf16) as the initial load of an empty folder, through the adapter
    hf_path = os.path.join(root, "final_hf", f"step-{SAVE_STEPS + 1}")
    h = build(os.path.join(root, "hf_start"), initial_load_path=hf_path, initial_load_in_hf=True)
    out["hf_flag"] = h["manager"].load()
    out["hf_params"] = snapshot(h)["params"]
    out["hf_loss"] = forward_loss(h)  # FSDP2's own view of the loaded shards (its load hooks ran)
    h["manager"].close()
    out["loss"] = forward_loss(t)
    return out
