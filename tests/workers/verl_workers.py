"""Rank functions of tests/integration/integrations/test_verl.py: verl's real pieces as its FSDP engine uses
them, on gloo CPU ranks. A tiny Hugging Face Llama sharded with verl's ``apply_fsdp2`` (FSDP2, a
1-D ``fsdp`` mesh), verl's ``build_optimizer`` (AdamW over ``module.parameters()``) and
``get_cosine_schedule_with_warmup``; with ``offload=True`` the model is sharded with FSDP2's
``CPUOffloadPolicy`` as verl's engine does for ``offload_policy: true`` (``pin_memory=False``:
pinning needs an accelerator; the engine then calls the manager without moving the model, its
``_uses_fsdp2_cpu_offload_policy`` branch); the manager is built by the name verl's engine module looks
up (``transformer_impl.FSDPCheckpointManager``) after ``install()``, with the engine's keyword
arguments, and called as ``FSDPEngine.save_checkpoint`` / ``load_checkpoint`` call it.
(verl's ``FSDPEngine`` itself needs a CUDA platform: ``fsdp2_load_full_state_dict`` moves the
model to ``get_device_id()``, so it is not constructed here.)

Expected values are the saving ranks' own tensors (``full_tensor``), never read back through
unickpt."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

VOCAB = 64


def _rank_ws() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def build(
    seed: int = 0,
    save_contents: list[str] | None = None,
    load_contents: list[str] | None = None,
    async_save: bool = False,
    role: str | None = None,
    offload: bool = False,
) -> dict[str, Any]:
    """verl's pieces at this world size, and the manager verl's engine would build."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from transformers import LlamaConfig, LlamaForCausalLM
    from verl.trainer.config import CheckpointConfig
    from verl.utils.fsdp_utils import apply_fsdp2
    from verl.utils.torch_functional import get_cosine_schedule_with_warmup
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer
    from verl.workers.engine.fsdp import transformer_impl

    from unickpt.integrations.verl import UnickptFSDPCheckpointManager

    _, ws = _rank_ws()
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=["fsdp"])
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
    policy = CPUOffloadPolicy(pin_memory=False) if offload else None
    apply_fsdp2(model, {"mesh": mesh, "mp_policy": mp, "offload_policy": policy, "reshard_after_forward": True}, {})
    optimizer = build_optimizer(model.parameters(), FSDPOptimizerConfig(lr=1e-2, total_training_steps=20))
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=20)
    ckpt_cfg = CheckpointConfig(
        save_contents=save_contents or ["model", "optimizer", "extra"],
        load_contents=load_contents or ["model", "optimizer", "extra"],
        async_save=async_save,
    )
    cls = transformer_impl.FSDPCheckpointManager  # the name verl's engine looks up
    if role is not None:
        assert cls is UnickptFSDPCheckpointManager
        cls = UnickptFSDPCheckpointManager.with_role(role)
    manager = cls(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        processing_class=None,
        checkpoint_config=ckpt_cfg,
        trust_remote_code=False,
    )
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "manager": manager}


def train_step(t: dict[str, Any], step: int) -> float:
    rank, _ = _rank_ws()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))
    loss = t["model"](input_ids=ids, labels=ids).loss
    loss.backward()
    t["optimizer"].step()
    t["scheduler"].step()
    t["optimizer"].zero_grad()
    torch.rand(3), np.random.rand(), random.random()  # the job draws from every generator
    return float(loss.detach())


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(t: dict[str, Any]) -> dict[str, Any]:
    """Whole tensors by name: parameters, optimizer state, the scheduler and this rank's RNG."""
    model, optim = t["model"], t["optimizer"]
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "optim": {names[id(p)]: {k: _full(v) for k, v in s.items()} for p, s in optim.state.items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups],
        "sched": {k: v for k, v in t["scheduler"].state_dict().items() if k != "lr_lambdas"},
        "rng": [torch.get_rng_state(), torch.tensor(np.random.get_state()[1].astype(np.int64)), random.random()],
    }


def _snapshot_keeping_rng(t: dict[str, Any]) -> dict[str, Any]:
    """``snapshot`` without moving the generators (it draws from ``random``): taken right before
    a save, it is what that save must hold."""
    state = _rng_state()
    out = snapshot(t)
    _set_rng_state(state)
    return out


def save_ws2(rank: int, ws: int, root: str) -> dict[str, Any]:
    """ws=2: unickpt saves (async, retention, roles, hf_model), resume at ws=2 from the
    synchronous step 3 and the async step 2 (its write overlapped step 3's training), verl's own
    manager saves and resumes the same state at the same size; an FSDP2 model with
    ``CPUOffloadPolicy`` saves and resumes."""
    from unickpt.integrations.verl import install

    out: dict[str, Any] = {"installed": install()}
    from verl.workers.engine.fsdp import transformer_impl

    out["patched"] = transformer_impl.FSDPCheckpointManager.__name__
    t = build(async_save=True)
    m = t["manager"]
    run = os.path.join(root, "run")
    for step in (1, 2, 3):
        train_step(t, step)
        if step == 2:
            out["saved_async"] = _snapshot_keeping_rng(t)
        if step == 3:
            m.checkpoint_save_contents = ["model", "optimizer", "extra", "hf_model"]
            m.async_save = False
        m.save_checkpoint(os.path.join(run, f"global_step_{step}", "actor"), global_step=step, max_ckpt_to_keep=2)
        if step == 1 and rank == 0:
            m.wait()  # committed: the user's file beside it must outlive retention
            with open(os.path.join(run, "global_step_1", "actor", "notes.txt"), "w") as f:
                f.write("mine")
    state = _rng_state()
    out["saved"] = snapshot(t)
    _set_rng_state(state)
    out["saved_loss"] = _eval_loss(t)
    out["files"] = {s: sorted(os.listdir(os.path.join(run, s, "actor"))) for s in sorted(os.listdir(run))}
    # resume at the same size after the state moved on
    train_step(t, 4)
    m.load_checkpoint(os.path.join(run, "global_step_3", "actor"))
    out["resumed"] = snapshot(t)
    m.load_checkpoint(os.path.join(run, "global_step_2", "actor"))  # the async save's contents
    out["resumed_async"] = snapshot(t)
    # load_contents=["model"]: the weights only
    train_step(t, 5)
    only_model = build(seed=7, load_contents=["model"])
    only_model["manager"].load_checkpoint(os.path.join(run, "global_step_3", "actor"))
    out["model_only"] = snapshot(only_model)
    # verl's own manager: the same saved state, saved and resumed at the same size
    m.load_checkpoint(os.path.join(run, "global_step_3", "actor"))
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    own = FSDPCheckpointManager(
        model=t["model"],
        optimizer=t["optimizer"],
        lr_scheduler=t["scheduler"],
        processing_class=None,
        checkpoint_config=m.checkpoint_config,
        trust_remote_code=False,
    )
    own.save_checkpoint(os.path.join(root, "verl_own", "global_step_3", "actor"), global_step=3)
    train_step(t, 6)
    own.load_checkpoint(os.path.join(root, "verl_own", "global_step_3", "actor"))
    out["verl_resumed"] = snapshot(t)
    # actor and critic in one folder, as roles (two managers, one job)
    critic = build(seed=1, role="critic")
    train_step(critic, 1)
    actor = build(seed=2, role="actor")
    shared = os.path.join(root, "shared", "global_step_1")
    actor["manager"].save_checkpoint(shared, global_step=1)
    critic["manager"].save_checkpoint(shared, global_step=1)
    out["actor"], out["critic"] = snapshot(actor), snapshot(critic)
    out["shared"] = sorted(os.listdir(shared))
    out.update(_offloaded(root))
    for x in (t, only_model, critic, actor):
        x["manager"].close()
    out.update(_fsdp1(root))
    return out


def _offloaded(root: str) -> dict[str, Any]:
    """FSDP2 with ``CPUOffloadPolicy`` (verl's ``offload_policy: true``): an async save of the
    offloaded parameters and optimizer state, the state moved on, resumed at the same size."""
    t = build(seed=13, async_save=True, offload=True)
    train_step(t, 1)
    train_step(t, 2)
    # the policy took (FSDP2's per-module state; no public getter): every shard is an offloaded one
    groups = [m._get_fsdp_state()._fsdp_param_groups for m in t["model"].modules() if hasattr(m, "_get_fsdp_state")]
    policies = {type(g.offload_policy).__name__ for gs in groups for g in gs}
    saved = _snapshot_keeping_rng(t)
    path = os.path.join(root, "offload", "global_step_2", "actor")
    t["manager"].save_checkpoint(path, global_step=2)
    train_step(t, 3)
    t["manager"].load_checkpoint(path)
    resumed = snapshot(t)
    t["manager"].close()
    return {"offload_policies": sorted(policies), "offload_saved": saved, "offload_resumed": resumed}


def _fsdp1(root: str) -> dict[str, Any]:
    """verl's default strategy, FSDP1 (``use_orig_params=False``, decoder layers wrapped): saved by
    verl's own manager (for ``convert``) and by unickpt's, resumed by unickpt's at the same size."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from verl.trainer.config import CheckpointConfig
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    from unickpt.integrations.verl import UnickptFSDPCheckpointManager

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(3)
    model = FSDP(
        LlamaForCausalLM(cfg), device_id=torch.device("cpu"), use_orig_params=False,
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    t = {"model": model, "optimizer": optimizer, "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2)}
    train_step(t, 1)

    def full() -> dict[str, torch.Tensor]:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}

    kwargs = {"model": model, "optimizer": optimizer, "lr_scheduler": t["scheduler"], "processing_class": None}
    kwargs["checkpoint_config"] = CheckpointConfig()
    FSDPCheckpointManager(**kwargs).save_checkpoint(os.path.join(root, "verl_fsdp1", "actor"), global_step=1)
    ours = UnickptFSDPCheckpointManager(**kwargs)
    ours.save_checkpoint(os.path.join(root, "unickpt_fsdp1", "actor"), global_step=1)
    saved = full()
    train_step(t, 2)
    ours.load_checkpoint(os.path.join(root, "unickpt_fsdp1", "actor"))
    resumed = full()
    ours.close()
    return {"fsdp1_saved": saved, "fsdp1_resumed": resumed}


def _rng_state() -> Any:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _set_rng_state(s: Any) -> None:
    torch.set_rng_state(s[0])
    np.random.set_state(s[1])
    random.setstate(s[2])


def _eval_loss(t: dict[str, Any]) -> float:
    ids = torch.arange(16).reshape(2, 8) % VOCAB
    with torch.no_grad():
        return float(t["model"](input_ids=ids, labels=ids).loss)


def load_other_ws(rank: int, ws: int, root: str) -> dict[str, Any]:
    """ws=1 or 3: a fresh job loads the unickpt checkpoint (the synchronous step 3 and the async
    step 2), the converted one of verl's own manager, and the critic's role; an FSDP2 model with
    ``CPUOffloadPolicy`` loads the step-3 checkpoint of the model without offload."""
    from unickpt.integrations.verl import install

    install()
    out: dict[str, Any] = {}
    t = build(seed=5)
    t["manager"].load_checkpoint(os.path.join(root, "run", "global_step_3", "actor"))
    state = _rng_state()
    out["resumed"] = snapshot(t)
    _set_rng_state(state)
    out["loss"] = _eval_loss(t)
    t["manager"].load_checkpoint(os.path.join(root, "run", "global_step_2", "actor"))
    out["resumed_async"] = snapshot(t)
    offloaded = build(seed=12, offload=True)
    offloaded["manager"].load_checkpoint(os.path.join(root, "run", "global_step_3", "actor"))
    out["offload_loss"] = _eval_loss(offloaded)  # a forward through FSDP's own (offloaded) shards
    out["offload_resumed"] = snapshot(offloaded)
    conv = build(seed=6)
    conv["manager"].load_checkpoint(os.path.join(root, "converted"))
    out["converted"] = snapshot(conv)
    critic = build(seed=9, role="critic")
    critic["manager"].load_checkpoint(os.path.join(root, "shared", "global_step_1"))
    out["critic"] = snapshot(critic)
    # FSDP1 (use_orig_params=False) saved at ws=2 -> FSDP2 here: the weights by name
    cross = build(seed=11, load_contents=["model"])
    cross["manager"].load_checkpoint(os.path.join(root, "unickpt_fsdp1", "actor"))
    out["fsdp1_into_fsdp2"] = snapshot(cross)["params"]
    for x in (t, offloaded, conv, critic, cross):
        x["manager"].close()
    return out
