"""Rank functions of the Megatron checkpoint tests (spawned by ``harness.run_ranks``).

``save_job`` trains a megatron-core GPT at one layout, saves it with ``framework="megatron"``,
gathers the oracle (full model and optimizer state, gathered with plain torch.distributed by
the test bed, not by unickpt) and then keeps training one step: that step's loss and the model
after it are what a resumed job must reproduce. ``load_job`` builds another layout from another
seed (every tensor differs), loads, gathers the same oracle and takes the same next step.
Results travel in unickpt's safe value encoding; rank 0 returns the full states."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import unickpt
from tests.workers import megatron_env as env
from unickpt.options import RestoreOptions

SAVE_SEED, LOAD_SEED = 1234, 999
STEP = 0  # the training step saved after; the next one is STEP + 1


def _state(chunks: list[Any], opt: Any) -> dict[str, Any]:
    return {
        "model": env.full_model_state(chunks, sharded_keys=True),
        "optim": env.full_optimizer_state(chunks, opt, sharded_keys=True),
    }


def save_job(
    rank: int,
    world: int,
    path: str,
    tp: int,
    pp: int,
    dp: int,
    dist_opt: bool,
    vp: int | None = None,
    bf16: bool = False,
    build: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``build``: more build_gpt arguments (``num_moe_experts``, ``ep``, ``gated``)."""
    chunks, opt = env.build_gpt(
        tp, pp, dp, seed=SAVE_SEED, use_distributed_optimizer=dist_opt, virtual_pp=vp, bf16=bf16, **(build or {})
    )
    env.train_step(chunks, opt, STEP)
    unickpt.save(path, {"model": chunks, "optimizer": opt}, framework="megatron")
    saved = _state(chunks, opt)
    loss = env.train_step(chunks, opt, STEP + 1)
    after = env.full_model_state(chunks, sharded_keys=True)
    return {"loss": loss, **saved, "after": after} if rank == 0 else {"loss": loss}


def load_job(
    rank: int,
    world: int,
    path: str,
    tp: int,
    pp: int,
    dp: int,
    dist_opt: bool,
    vp: int | None = None,
    bf16: bool = False,
    warm: bool = False,
    framework: str = "megatron",
    cast_dtypes: bool = False,
    vocab: int = 64,
    build: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``warm``: take a step before loading, so the optimizer already has state (loaded in
    place); otherwise it has none yet and the load creates it."""
    chunks, opt = env.build_gpt(
        tp,
        pp,
        dp,
        seed=LOAD_SEED,
        use_distributed_optimizer=dist_opt,
        virtual_pp=vp,
        bf16=bf16,
        vocab=vocab,
        **(build or {}),
    )
    initial = env.full_model_state(chunks, sharded_keys=True)
    if warm:
        env.train_step(chunks, opt, 7)
    options = unickpt.LoadOptions(restore=RestoreOptions(cast_dtypes=cast_dtypes))
    unickpt.load(path, {"model": chunks, "optimizer": opt}, framework=framework, options=options)
    loaded = _state(chunks, opt)
    loss = env.train_step(chunks, opt, STEP + 1)
    after = env.full_model_state(chunks, sharded_keys=True)
    groups = [
        {k: v for k, v in g.items() if k in ("lr", "weight_decay", "wd_mult", "betas")}
        for o in opt.chained_optimizers
        for g in o.optimizer.param_groups
    ]
    out = {"loss": loss, "groups": groups}
    return {**out, **loaded, "after": after, "initial": initial} if rank == 0 else out


def consolidate_job(rank: int, world: int, path: str, fsdp2: bool) -> dict[str, Any]:
    """Load a Megatron checkpoint into megatron's GPTModel used as a plain torch module (TP1, no
    megatron DDP or optimizer; ``fsdp2``: fully_shard over all ranks) under its module names
    (``key_map`` undoes megatron's sharded-key renames), with a torch AdamW; return the full
    model and the optimizer state under the module names, gathered by torch (full_tensor)."""
    chunks, _ = env.build_gpt(1, 1, world, seed=LOAD_SEED, use_distributed_optimizer=False)
    gpt = env._unwrap(chunks[0])
    # a fresh module tree, no megatron wrappers: the evaluation model
    names = {env.global_param_name(gpt, n, sharded_keys=True): n for n, _ in gpt.named_parameters()}
    model: torch.nn.Module = gpt
    framework = "torch"
    if fsdp2:
        from torch.distributed.fsdp import fully_shard

        for layer in gpt.decoder.layers:
            fully_shard(layer)
        fully_shard(gpt)
        framework = "fsdp2"
    # megatron's two groups: weight decay for matrices, none for 1-D tensors and biases
    decayed = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    others = [p for n, p in model.named_parameters() if not (p.dim() > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decayed}, {"params": others}], lr=0.5)

    def key_map(key: str) -> str | None:
        for prefix in ("model.", "optimizer.state.", "optimizer.param_groups."):
            if key.startswith(prefix):
                rest = key[len(prefix) :]
                for sharded, name in names.items():
                    if rest == sharded or rest.startswith(sharded + "."):
                        return prefix + name + rest[len(sharded) :]
        if key.startswith("optimizer.main_params."):
            return None
        return key

    unickpt.load(
        path,
        {"model": model, "optimizer": opt},
        framework=framework,
        options=unickpt.LoadOptions(restore=RestoreOptions(key_map=key_map)),
    )

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()

    params = dict(model.named_parameters())
    model_out = {n: full(p) for n, p in params.items()}
    optim_out = {
        n: {k: full(v) for k, v in opt.state[p].items() if k in ("exp_avg", "exp_avg_sq")}
        for n, p in params.items()
        if p in opt.state
    }
    lrs = {n: float(g["lr"]) for g in opt.param_groups for n, p in params.items() if any(p is q for q in g["params"])}
    dist.barrier()
    return {"model": model_out, "optim": optim_out, "names": names, "lr": lrs} if rank == 0 else {}


def loader_job(
    rank: int, world: int, path: str, tp: int, pp: int, dp: int, sources: dict[str, list[str]], mode: str
) -> list[int]:
    """A Megatron job whose dataloader lives on TP rank 0 of the first pipeline stage of each DP
    group (the other ranks pass none). ``mode`` "save": consume 1 + dp_rank batches, train a
    step, save; "load": restore (any layout) and drain. Returns the tokens this rank consumed."""
    from megatron.core import parallel_state as ps

    from tests.workers.loader_data import drain, make_loader

    chunks, opt = env.build_gpt(tp, pp, dp, seed=SAVE_SEED, use_distributed_optimizer=True)
    owner = ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_first_stage(ignore_virtual=True)
    dp_rank = ps.get_data_parallel_rank()
    loader = make_loader(sources, dp_rank, dp) if owner else None
    state: dict[str, Any] = {"model": chunks, "optimizer": opt}
    if loader is not None:
        state["dataloader"] = loader
    if mode == "save":
        seen = drain(loader, limit=1 + dp_rank) if loader is not None else []
        env.train_step(chunks, opt, STEP)
        unickpt.save(path, state, framework="megatron")
        return seen
    unickpt.load(path, state, framework="megatron")
    return drain(loader) if loader is not None else []


def careless_job(rank: int, world: int, path: str) -> dict[str, Any]:
    """One rank: what a careless user gets. Returns the detected framework, the errors' texts and
    whether a torch AdamW over a megatron model round-trips."""
    from unickpt.errors import CheckpointError
    from unickpt.frameworks import FRAMEWORKS

    chunks, opt = env.build_gpt(1, 1, 1, seed=SAVE_SEED, use_distributed_optimizer=True)
    out: dict[str, Any] = {"detected": FRAMEWORKS.detect({"model": chunks, "optimizer": opt}).name}
    try:
        unickpt.save(path + "-linear", {"model": torch.nn.Linear(2, 2)}, framework="megatron")
    except CheckpointError as e:
        out["not_megatron"] = str(e)
    env.train_step(chunks, opt, STEP)
    unickpt.save(path, {"model": chunks, "optimizer": opt})  # framework="auto"
    wider, wider_opt = env.build_gpt(1, 1, 1, seed=LOAD_SEED, use_distributed_optimizer=True, hidden=48)
    try:
        unickpt.load(path, {"model": wider, "optimizer": wider_opt})
    except CheckpointError as e:
        out["other_shape"] = str(e)
    # a plain torch optimizer over a megatron model's parameters
    gpt = env._unwrap(chunks[0])
    adam = torch.optim.AdamW(gpt.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    for p in gpt.parameters():  # megatron's DDP hooks would move autograd's grads to main_grad
        p.grad = torch.randn(p.shape, generator=gen)
    adam.step()
    unickpt.save(path + "-adam", {"model": gpt, "optimizer": adam}, framework="megatron")
    fresh, _ = env.build_gpt(1, 1, 1, seed=LOAD_SEED, use_distributed_optimizer=False)
    fresh_gpt = env._unwrap(fresh[0])
    fresh_adam = torch.optim.AdamW(fresh_gpt.parameters(), lr=0.5)
    unickpt.load(path + "-adam", {"model": fresh_gpt, "optimizer": fresh_adam}, framework="megatron")
    pairs = list(zip(gpt.parameters(), fresh_gpt.parameters()))
    out["adam_round_trip"] = (
        all(
            torch.equal(a, b)
            and torch.equal(adam.state[a]["exp_avg"], fresh_adam.state[b]["exp_avg"])
            and torch.equal(adam.state[a]["step"], fresh_adam.state[b]["step"])
            for a, b in pairs
        )
        and fresh_adam.param_groups[0]["lr"] == 0.1
    )
    return out


# megatron-core GPT (local spec) key -> Hugging Face GPTNeoX name: the same tensors, same layout
# (Megatron's fused QKV is interleaved per head [q, k, v], as GPTNeoX's query_key_value is)
NEOX_LAYER = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "self_attention.linear_qkv.": "attention.query_key_value.",
    "self_attention.linear_proj.": "attention.dense.",
    "mlp.linear_fc1.layer_norm_": "post_attention_layernorm.",
    "mlp.linear_fc1.": "mlp.dense_h_to_4h.",
    "mlp.linear_fc2.": "mlp.dense_4h_to_h.",
}
NEOX_TOP = {
    "embedding.word_embeddings.weight": "gpt_neox.embed_in.weight",
    "decoder.final_layernorm.weight": "gpt_neox.final_layer_norm.weight",
    "decoder.final_layernorm.bias": "gpt_neox.final_layer_norm.bias",
    "output_layer.weight": "lm_head.weight",
}


def megatron_to_neox(key: str) -> str | None:
    """A megatron tensor key to its GPTNeoX name; None: GPTNeoX has no such tensor (learned
    position embeddings: it uses rotary ones)."""
    if key in NEOX_TOP:
        return NEOX_TOP[key]
    if key.startswith("decoder.layers."):
        layer, rest = key[len("decoder.layers.") :].split(".", 1)
        for old, new in NEOX_LAYER.items():
            if rest.startswith(old):
                return f"gpt_neox.layers.{layer}.{new}{rest[len(old) :]}"
    return None


def hf_job(rank: int, world: int, path: str) -> dict[str, Any]:
    """Load a Megatron checkpoint into a Hugging Face GPTNeoX model (and a torch AdamW) through
    LoadOptions(restore=RestoreOptions(key_map=...)); return its tensors and Adam moments by HF name."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=16,
        use_parallel_residual=False,
        tie_word_embeddings=False,
    )
    model = GPTNeoXForCausalLM(config)
    decayed = [p for n, p in model.named_parameters() if p.dim() > 1]
    others = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decayed}, {"params": others}], lr=0.5)
    state_prefixes = ("model.", "optimizer.state.", "optimizer.param_groups.")

    def key_map(key: str) -> str | None:
        for prefix in state_prefixes:
            if key.startswith(prefix):
                rest = key[len(prefix) :]
                if prefix == "optimizer.state.":  # <tensor key>.<state name>
                    tensor, _, name = rest.rpartition(".")
                    hf = megatron_to_neox(tensor)
                    return None if hf is None else f"{prefix}{hf}.{name}"
                hf = megatron_to_neox(rest)
                return None if hf is None else prefix + hf
        return None if key.startswith("optimizer.main_params.") else key

    unickpt.load(
        path, {"model": model, "optimizer": opt}, options=unickpt.LoadOptions(restore=RestoreOptions(key_map=key_map))
    )
    params = dict(model.named_parameters())
    return {
        "model": {n: p.detach().clone() for n, p in params.items()},
        "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in params.items()},
    }
