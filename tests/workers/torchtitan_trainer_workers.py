"""Rank functions of tests/integration/integrations/test_torchtitan_trainer.py: torchtitan's own
``Trainer`` (``torchtitan.trainer``, built by ``Trainer.Config.build()`` as ``torchtitan.train``
builds it) on one GPU, with ``UnickptCheckpointManager`` chosen through ``Trainer.Config.checkpoint``.

The job is torchtitan's ``llama3_debugmodel_ce_loss()`` config (its llama3 debug model, AdamW,
warmup + linear decay, its ``HuggingFaceTextDataLoader``, plain cross-entropy: the default
``ChunkedLossWrapper``'s backward fails under torch 2.11 on CPU, "data is not allocated yet") with these
changes, each a field of torchtitan's config:
  * attention: torchtitan's ``ScaledDotProductAttention`` in place of ``FlexAttention`` (the swap
    torchtitan's graph_trainer makes for its SDPA configs; no torch.compile of flex kernels);
  * a tokenizer (``tokenizer.json``, word level) and a JSON-lines text data set written into
    the test's folder (``make_assets``; no network), ``seq_len`` 64, batch 2, 6 steps;
  * ``debug.seed`` and ``debug.deterministic`` (bit-exact reruns), CUDA graphs off, no
    validation, TensorBoard metrics every step (the losses the test compares);
  * ``checkpoint = UnickptCheckpointManager.Config(interval=2, async_mode="async")``.

Order (one process, ``run_trainer_pair``): an uninterrupted run of 6 steps (async saves at 2
and 4, the last step's save blocking), then a second ``Trainer`` in another dump folder started
from the first run's ``step-4`` (``initial_load_path``, full state) that trains steps 5 and 6.
What each run's trainer held at its end (parameters as held, inner optimizer state, scheduler
epochs, train state) is read from torchtitan's objects, not through unickpt.

``load_on_cpu`` (gloo, ws=2, FSDP2): the GPU run's last checkpoint loaded into torchtitan's
model, optimizer and scheduler containers built from the same config on CPU.
"""

from __future__ import annotations

import glob
import json
import os
import random
from typing import Any

import torch

STEPS = 6
INTERVAL = 2
RESUME_STEP = 4
SEQ_LEN = 64
WORDS = 500


def make_assets(root: str) -> tuple[str, str]:
    """A word-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` naming BOS/EOS) and a
    JSON-lines data set of 400 documents, written under ``root``; their two folders."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(WORDS)]
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "data")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    tokenizer.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    rng = random.Random(0)
    with open(os.path.join(data_dir, "train.json"), "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 80)))}) + "\n")
    return tok_dir, data_dir


def _torch_compat() -> None:
    """Two torch names torchtitan 0.3.0 uses that released torch lacks (it follows torch nightly):
    * ``torch.distributed.set_timeout(timeout, group)``, called by its ``Trainer.train()`` after
      the first step (``distributed.utils.set_pg_timeouts``); absent in torch 2.11 and 2.13, whose
      ``distributed_c10d._set_pg_timeout(timeout, group)`` is the same operation: bound to that name;
    * ``torch.distributed.fsdp.DataParallelMeshDims``, imported at module level by
      ``distributed/full_dtensor.py`` (reached from ``torchtitan.trainer``), absent in torch 2.11
      (present in 2.13). Only the ``full_dtensor`` SPMD backend and the flux / deepseek models use
      it, never this job's path: a placeholder with its two fields lets the import succeed."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed import fsdp

    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout  # type: ignore[attr-defined]

    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:
            shard: Any = None
            replicate: Any = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims  # type: ignore[attr-defined]


def trainer_config(tok_dir: str, data_dir: str, dump: str, **checkpoint: Any) -> Any:
    """torchtitan's ``llama3_debugmodel_ce_loss()`` with the changes of the module docstring."""
    _torch_compat()
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel_ce_loss

    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    cfg = llama3_debugmodel_ce_loss()
    for _, _, parent, attr in list(cfg.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    cfg.hf_assets_path = tok_dir
    cfg.dump_folder = dump
    cfg.dataloader.dataset_path = data_dir
    cfg.training.seq_len = SEQ_LEN
    cfg.training.local_batch_size = 2
    cfg.training.steps = STEPS
    cfg.training.disable_cuda_graphs = True
    cfg.validator.enable = False
    cfg.metrics = MetricsProcessor.Config(log_freq=1, enable_tensorboard=True)
    cfg.debug.seed = 0
    cfg.debug.deterministic = True
    cfg.debug.deterministic_warn_only = True  # an op without a deterministic kernel warns, not fails
    cfg.checkpoint = UnickptCheckpointManager.Config(
        enable=True, interval=INTERVAL, async_mode="async", last_save_model_only=False, **checkpoint
    )
    return cfg


def tensorboard_losses(dump: str) -> dict[int, float]:
    """``loss_metrics/global_avg_loss`` per step, from the TensorBoard events torchtitan wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for path in sorted(glob.glob(os.path.join(dump, "tb", "**", "events.out.tfevents.*"), recursive=True)):
        acc = EventAccumulator(path)
        acc.Reload()
        if "loss_metrics/global_avg_loss" in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars("loss_metrics/global_avg_loss")})
    return out


_AC_WRAPPER = "_checkpoint_wrapped_module."


def _full(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (x.full_tensor() if isinstance(x, DTensor) else x).detach().to("cpu", copy=True)


def held_state(model_parts: list[torch.nn.Module], optimizers: Any, lr_schedulers: Any) -> dict[str, Any]:
    """Parameters as the model holds them (fused ``wqkv``), the inner optimizers' state by
    parameter name, the schedulers' epochs: read from torchtitan's objects (collective for DTensors).
    Names without the activation-checkpoint wrapper's ``_checkpoint_wrapped_module.`` (the
    Trainer's SelectiveAC wraps each layer; a model built without it has the plain names)."""
    names = {id(p): n.replace(_AC_WRAPPER, "") for part in model_parts for n, p in part.named_parameters()}
    return {
        "params": {names[id(p)]: _full(p) for part in model_parts for p in part.parameters()},
        "optim": {
            f"{names[id(p)]}.{k}": _full(v) if isinstance(v, torch.Tensor) else torch.tensor(v)
            for o in optimizers.optimizers
            for p, st in o.state.items()
            for k, v in st.items()
        },
        "sched": [s.last_epoch for s in lr_schedulers.schedulers],
    }


def _run(cfg: Any) -> dict[str, Any]:
    """``torchtitan.train.main``'s body: build, train, close; what the trainer held at its end."""
    trainer = cfg.build()
    try:
        trainer.train()
        out = held_state(trainer.model_parts, trainer.optimizers, trainer.lr_schedulers)
        out["step"] = trainer.step
        out["device"] = str(next(trainer.model_parts[0].parameters()).device)
    finally:
        trainer.close()
    out["losses"] = tensorboard_losses(cfg.dump_folder)
    return out


def run_trainer_pair(rank: int, ws: int, root: str, tok_dir: str, data_dir: str, port: int) -> dict[str, Any]:
    """One process (``run_ranks(..., 0, ...)``: no process group yet): the launcher variables
    torchrun would set (world size 1), torchtitan's own process-group set-up from them (NCCL on
    CUDA), then the uninterrupted run and the resumed run (module docstring)."""
    del rank, ws
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=os.path.join(root, "hf_cache"),
    )  # fmt: skip
    full = _run(trainer_config(tok_dir, data_dir, os.path.join(root, "full")))
    step_dir = os.path.join(root, "full", "checkpoint", f"step-{RESUME_STEP}")
    resumed = _run(
        trainer_config(
            tok_dir, data_dir, os.path.join(root, "resumed"), initial_load_path=step_dir, initial_load_model_only=False
        )
    )
    folders = sorted(os.listdir(os.path.join(root, "full", "checkpoint")))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return {"full": full, "resumed": resumed, "folders": folders}


def load_on_cpu(rank: int, ws: int, root: str, tok_dir: str, data_dir: str) -> dict[str, Any]:
    """gloo ranks on CPU: torchtitan's debug model (same config) under FSDP2 (one ``fully_shard``
    per layer and the root), its optimizer and scheduler containers from the config, and the
    manager's load of the GPU run's last checkpoint (``initial_load_path``, full state; the
    per-rank dataloader state of ws=1 is skipped: ``dataloader_on_resize="skip"``)."""
    from torch.distributed.fsdp import fully_shard

    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=os.path.join(root, "hf_cache"))

    cfg = trainer_config(tok_dir, data_dir, os.path.join(root, f"cpu_ws{ws}"))
    with torch.device("meta"):
        model = cfg.model_spec.model.build()
    for layer in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optimizers = cfg.optimizer.build(model_parts=[model])
    lr_schedulers = cfg.lr_scheduler.build(optimizers=optimizers, training_steps=cfg.training.steps)
    dataloader = cfg.dataloader.build(
        dp_world_size=ws,
        dp_rank=rank,
        tokenizer=cfg.tokenizer.build(tokenizer_path=tok_dir),
        seq_len=SEQ_LEN,
        local_batch_size=cfg.training.local_batch_size,
    )

    class TrainState:  # the Trainer's own ``state_dict`` pair (the Trainer is not built here)
        step = 0
        ntokens_seen = 0

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step, "ntokens_seen": self.ntokens_seen}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]

    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    train_state = TrainState()
    step_dir = os.path.join(root, "full", "checkpoint", f"step-{STEPS}")
    manager = UnickptCheckpointManager.Config(
        enable=True, initial_load_path=step_dir, initial_load_model_only=False, dataloader_on_resize="skip"
    ).build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=cfg.dump_folder,
    )
    try:
        loaded = manager.load()
    finally:
        manager.close()
    out = held_state([model], optimizers, lr_schedulers)
    out["loaded"] = loaded
    out["step"] = train_state.step
    return out
