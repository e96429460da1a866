"""Rank functions of tests/integration/integrations/test_accelerate.py: a tiny ``LlamaForCausalLM`` (2 layers,
hidden 32, built from a config: no download) trained with a real ``accelerate.Accelerator`` (DDP
over gloo on the harness's ranks), checkpointed with unickpt's ``save_state`` and with Accelerate's
own ``accelerator.save_state`` in the same spawn, then resumed from each side by side."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import unickpt
from unickpt.integrations.accelerate import load_state, save_state
from unickpt.integrations.hf_trainer import UnickptTrainerMixin
from unickpt.options import RestoreOptions

GLOBAL_BATCH, SEQ, VOCAB = 6, 8, 64  # 6 rows: 3, 2 or 6 per rank at ws 2, 3, 1
SAVED_AT, STEPS = 3, 6  # saved after 3 steps; 3 more after a resume


class Counter:
    """A custom object for ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


def _llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def _build(seed: int, custom: bool = True) -> tuple[Accelerator, Any, Any, Any, Counter]:
    model = _llama(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    acc = Accelerator(cpu=True)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    if custom:
        acc.register_for_checkpointing(counter)
    return acc, model, opt, sched, counter


def _step(i: int, rank: int, ws: int, acc: Accelerator, model: Any, opt: Any, sched: Any, counter: Counter) -> float:
    """Global batch ``i`` (the same at every world size), this rank's rows."""
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(i))
    rows = ids[rank * GLOBAL_BATCH // ws : (rank + 1) * GLOBAL_BATCH // ws]
    loss = model(input_ids=rows, labels=rows).loss
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    counter.n += 1
    return loss.item()


def _path(root: str, backend: str) -> str:
    return os.path.join(root, backend)


def train(rank: int, ws: int, root: str) -> dict[str, Any]:
    """ws=2: 3 steps, both saves (unickpt's async), a draw of the RNG, 3 more steps; then the
    resumes at this world size; then the HF Trainer, uninterrupted, then resumed."""
    objs = _build(0)
    acc = objs[0]
    losses = [_step(i, rank, ws, *objs) for i in range(SAVED_AT)]
    acc.step = 7  # a non-default accumulation counter, to see it restored
    handle = save_state(acc, _path(root, "unickpt"), async_save=True)
    acc.save_state(_path(root, "stock"))
    handle.wait()
    drawn = torch.rand(4).tolist()  # the RNG right after the saves
    losses += [_step(i, rank, ws, *objs) for i in range(SAVED_AT, STEPS)]
    out = {"losses": losses, "drawn": drawn}
    out.update(resume(rank, ws, root))
    out["loader"] = stateful_loader(rank, ws, root)
    for backend in ("unickpt", "stock"):  # the HF Trainer, uninterrupted, 6 steps
        out[f"trainer/{backend}/losses"] = _fit(backend, ws, os.path.join(root, "hf", backend), False)
        out[f"trainer/{backend}/folders"] = sorted(os.listdir(os.path.join(root, "hf", backend)))
    out.update(resume_trainer(rank, ws, root))
    return out


def _differences(a: tuple, b: tuple) -> list[str]:
    """Names of what differs between two resumed (accelerator, model, opt, sched, counter)."""
    bad = []
    for (name, x), y in zip(a[1].state_dict().items(), b[1].state_dict().values(), strict=True):
        if not torch.equal(x, y):
            bad.append(f"model.{name}")
    sa, sb = a[2].optimizer.state_dict(), b[2].optimizer.state_dict()
    if sa["param_groups"] != sb["param_groups"] or sa["state"].keys() != sb["state"].keys():
        bad.append("optimizer groups")
    for pid, st in sa["state"].items():
        for k, v in st.items():
            if not torch.equal(v, sb["state"][pid][k]):
                bad.append(f"optimizer.{pid}.{k}")
    if a[3].scheduler.state_dict() != b[3].scheduler.state_dict():
        bad.append("scheduler")
    if a[4].n != b[4].n:
        bad.append("custom object")
    return bad


def resume(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Fresh objects (other seed, scrambled RNG), loaded from each backend's checkpoint, then 3
    steps; what unickpt loaded is compared with what Accelerate's own ``load_state`` loaded."""
    out: dict[str, Any] = {}
    resumed = {}
    for backend in ("unickpt", "stock"):
        objs = _build(100 + rank)
        torch.manual_seed(1000 + rank)  # the RNG must come from the checkpoint
        if backend == "unickpt":
            load_state(objs[0], _path(root, backend))
        else:
            objs[0].load_state(_path(root, backend))
        out[f"{backend}/drawn"] = torch.rand(4).tolist()
        out[f"{backend}/counters"] = [objs[4].n, objs[0].step]
        resumed[backend] = objs
    out["differences"] = _differences(resumed["unickpt"], resumed["stock"])
    for backend, objs in resumed.items():
        out[f"{backend}/losses"] = [_step(i, rank, ws, *objs) for i in range(SAVED_AT, STEPS)]
    # strict per key: an accelerator without the registered object refuses the checkpoint
    acc = _build(0, custom=False)[0]
    try:
        load_state(acc, _path(root, "unickpt"))
        out["strict"] = "loaded"
    except unickpt.CheckpointError as e:
        out["strict"] = type(e).__name__
    load_state(acc, _path(root, "unickpt"), strict=False)
    out["non-strict"] = "loaded"
    return out


def _loader() -> tuple[Accelerator, Any]:
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    data = torch.utils.data.TensorDataset(torch.arange(48))
    return acc, acc.prepare(torch.utils.data.DataLoader(data, batch_size=2))


def stateful_loader(rank: int, ws: int, root: str) -> dict[str, Any]:
    """A stateful dataloader: at the saved size (2) it goes on where it was; at another size its
    per-rank position cannot be split (``LoaderStateError``) unless ``loader_on_resize="skip"``."""
    path = os.path.join(root, "loader")
    if ws == 2:
        acc, loader = _loader()
        batches = iter(loader)
        before = [next(batches)[0].tolist() for _ in range(2)]
        save_state(acc, path)
        expected = [next(batches)[0].tolist() for _ in range(2)]
        acc, loader = _loader()
        load_state(acc, path)
        batches = iter(loader)
        return {"before": before, "expected": expected, "resumed": [next(batches)[0].tolist() for _ in range(2)]}
    acc, loader = _loader()
    try:
        load_state(acc, path)
        return {"resize": "loaded"}
    except unickpt.CheckpointError as e:
        load_state(acc, path, options=unickpt.LoadOptions(restore=RestoreOptions(loader_on_resize="skip")))
        return {"resize": type(e).__name__, "skipped": [next(iter(loader))[0].tolist()]}


# ---------------------------------------------------------------- the HF Trainer


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 6 * GLOBAL_BATCH

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1000 + i))
        return {"input_ids": ids, "labels": ids}


class _Recording:
    """Records each micro-batch's loss on this rank."""

    losses: list[float]

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]
        self.losses.append(loss.item())
        return loss


class OursTrainer(_Recording, UnickptTrainerMixin, Trainer):
    unickpt_async_save = True


class StockTrainer(_Recording, Trainer):
    pass


def _fit(backend: str, ws: int, out_dir: str, resume: bool) -> list[float]:
    """6 steps of global batch 6, a checkpoint every 2 (the newest 2 kept); ``resume``: from the
    newest ``checkpoint-N`` in ``out_dir`` (``resume_from_checkpoint=True``), fresh weights."""
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_BATCH // ws,
        learning_rate=1e-2,
        save_steps=2,
        save_total_limit=2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
    )
    cls = OursTrainer if backend == "unickpt" else StockTrainer
    trainer = cls(model=_llama(100 if resume else 0), args=args, train_dataset=_Rows())
    trainer.losses = []
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer.losses


def resume_trainer(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Each backend's checkpoint-4 copied to a folder of this world size, then the Trainer resumes
    there with ``resume_from_checkpoint=True`` and runs steps 5 and 6."""
    out: dict[str, Any] = {}
    for backend in ("unickpt", "stock"):
        target = os.path.join(root, "hf", backend, f"ws{ws}")
        if rank == 0:
            shutil.copytree(os.path.join(root, "hf", backend, "checkpoint-4"), os.path.join(target, "checkpoint-4"))
        torch.distributed.barrier()
        out[f"trainer/{backend}/resumed"] = _fit(backend, ws, target, True)
        out[f"trainer/{backend}/resumed-folders"] = sorted(os.listdir(target))
    return out


# ---------------------------------------------------------------- the HF Trainer on the RAM tier


class TierTrainer(_Recording, UnickptTrainerMixin, Trainer):
    """The mixin with fast recovery turned on (issue 40: the RAM tier, one replica per host)."""

    unickpt_async_save = True
    unickpt_fast_root = "shm://hfjob"
    unickpt_replicas = 1
    unickpt_durable_every = 100  # no step reaches the durable folder: a resume reads RAM only
    unickpt_keep_fast = 2


def _fit_tier(cls: type, ws: int, out_dir: str, max_steps: int, resume: bool) -> tuple[list[float], Any]:
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=max_steps,
        per_device_train_batch_size=GLOBAL_BATCH // ws,
        learning_rate=1e-2,
        lr_scheduler_type="constant",  # the same schedule whatever max_steps is
        save_steps=2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
    )
    trainer = cls(model=_llama(100 if resume else 0), args=args, train_dataset=_Rows())
    trainer.losses = []
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer.losses, getattr(trainer, "unickpt_last_recovery", None)


def trainer_on_the_ram_tier(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Rank r is on host "abc"[r] (its own RAM folder). An uninterrupted run of 6 steps (unickpt
    without the tier); a run on the tier to step 4 (saves at 2 and 4); host b's RAM lost; a
    resumed run to step 6 (``resume_from_checkpoint=True``, fresh weights): its losses, the
    folders, and where the resume's bytes came from."""
    from tests.workers.recovery_workers import enter_host

    enter_host(root, "abc"[rank])
    out: dict[str, Any] = {}
    out["uninterrupted"], _ = _fit_tier(OursTrainer, ws, os.path.join(root, "plain"), 6, False)
    tiered = os.path.join(root, "tiered")
    out["first"], _ = _fit_tier(TierTrainer, ws, tiered, 4, False)
    out["folders"] = {n: sorted(os.listdir(os.path.join(tiered, n))) for n in sorted(os.listdir(tiered))}
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(root, "ram", "b"))  # host b's RAM is gone
    torch.distributed.barrier()
    out["resumed"], report = _fit_tier(TierTrainer, ws, tiered, 6, True)
    out["recovery"] = {"step": report.step, "tier": report.tier, "bytes": report.bytes_by_source}
    return out
