"""A tiny megatron-core ``GPTModel`` on CPU under gloo, for any TP x PP x DP split (virtual
pipeline stages too): the test bed of the Megatron adapter (see docs/notes/megatron-cpu.md).

* ``apply_cpu_patches()``: the small, named patches (``PATCHES``) that let megatron-core 0.16
  run on a CPU-only torch build. Test-only: library code under ``src/`` is never patched.
* ``build_gpt(tp, pp, dp, seed=..., use_distributed_optimizer=...)``: inside an initialised
  gloo group of ``tp*pp*dp`` ranks: megatron's parallel state, the model chunks (local layer
  spec, ``use_cpu_initialization``), megatron's DDP wrapper and megatron's Adam
  (``ChainedOptimizer`` around a ``DistributedOptimizer``, an ``FP32Optimizer`` or, with
  ``bf16=True``, a ``Float16OptimizerWithFloat16Params``). The weights are a function of
  ``seed`` and the global parameter name only, so every layout holds the same full model.
* ``train_step(model_chunks, optimizer, step)``: one forward/backward/optimizer step through
  megatron's pipeline schedules on a deterministic global batch; the loss on every rank.
* ``full_model_state`` / ``full_optimizer_state``: the test oracle, gathered with plain
  ``torch.distributed`` (never megatron's dist_checkpointing): full tensors under global names
  (``decoder.layers.<global layer>.…``); Adam's ``exp_avg`` / ``exp_avg_sq`` and the fp32 main
  param per parameter. ``load_full_model_state`` puts such a full state into any layout.
* ``sharded_state_dict_report``: megatron's own ``sharded_state_dict()`` checked against the oracle.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = [
    "PATCHES",
    "apply_cpu_patches",
    "cpu_device_mode",
    "build_gpt",
    "train_step",
    "global_batch",
    "full_model_state",
    "full_optimizer_state",
    "local_param_names",
    "load_full_model_state",
    "sharded_state_dict_report",
    "global_param_name",
    "reference_tensor",
]

GLOBAL_BATCH = 4  # sequences per step, split over the DP ranks (one sequence per micro-batch)
LR = 1e-2


# ----------------------------------------------------------------------------------------------
# CPU patches
# ----------------------------------------------------------------------------------------------


class Patch(NamedTuple):
    name: str
    why: str


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, int):  # a bare index means a CUDA device
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, torch.device) and dev.type == "cuda"


class _CpuDeviceMode(TorchFunctionMode):
    """Inside megatron code that assumes CUDA: a factory call asking for a CUDA device gets the
    CPU, ``Tensor.cuda()`` / ``Tensor.to('cuda')`` stay on the CPU, and a bare ``Tensor.type()``
    answers with the CUDA type name (``'torch.cuda.FloatTensor'``) that megatron's dtype checks
    compare against."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Run megatron code that allocates on ``'cuda'`` with the CPU instead (see ``_CpuDeviceMode``)."""
    with _CpuDeviceMode():
        yield


def _on_cpu(fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, "__unickpt_on_cpu__", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _CpuDeviceMode():
            return fn(*args, **kwargs)

    wrapper.__unickpt_on_cpu__ = True  # type: ignore[attr-defined]
    return wrapper


def _tracker_add(self: Any, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` keeping a CPU generator state per name."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def _tracker_fork(self: Any, name: str = "model-parallel-rng") -> Iterator[None]:
    """``CudaRNGStatesTracker.fork`` swapping the CPU default generator's state."""
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    orig = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)


# (name, why, where) for the functions wrapped in ``_CpuDeviceMode``: module path, attribute path
_ON_CPU_TARGETS: list[tuple[str, str, str]] = [
    (
        "optimizer_init_on_cpu",
        "the optimizers' __init__ allocate found_inf / _scale_one / _scale on device='cuda' and accept "
        "only params whose .type() is 'torch.cuda.{Float,Half,BFloat16}Tensor'",
        "megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.__init__,FP32Optimizer.__init__,"
        "Float16OptimizerWithFloat16Params.__init__;"
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
    ),
    (
        "optimizer_step_on_cpu",
        "the step's grad norm / clipping / zero count (clip_grads.py) allocate on device='cuda'",
        "megatron.core.optimizer.optimizer:ChainedOptimizer.step,MixedPrecisionOptimizer.step,FP32Optimizer.step",
    ),
    (
        "schedules_on_cpu",
        "the forward-backward schedules allocate total_num_tokens on device='cuda'",
        "megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining,"
        "forward_backward_pipelining_without_interleaving,forward_backward_pipelining_with_interleaving",
    ),
    (
        "optimizer_state_gather_on_cpu",
        "DistributedOptimizer.get_parameter_state_dp_zero (behind the 'fully_reshardable' and "
        "'dp_zero_gather_scatter' sharded_state_dict formats) moves its DP-gather buffers with .cuda()",
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.get_parameter_state_dp_zero",
    ),
]

PATCHES: list[Patch] = [
    Patch(
        "rng_tracker_on_cpu",
        "CudaRNGStatesTracker.add/fork (model_parallel_cuda_manual_seed, the attention-dropout fork) "
        "keep the named RNG states as CPU generator states instead of torch.cuda RNG states",
    ),
    Patch(
        "cuda_current_device_is_cpu",
        "torch.cuda.current_device() returns 'cpu': DDP param/grad buffers, p2p receive buffers and TP "
        "gather outputs are allocated 'on the current device'",
    ),
    Patch("cuda_synchronize_noop", "torch.cuda.synchronize() is a no-op (p2p communication and timers call it)"),
    Patch(
        "moe_router_gemm_without_te",
        "transformer/moe/moe_utils.py:RouterGatingLinearFunction.forward tests `te_general_gemm is not "
        "None`, a name 0.16.1 defines only when TransformerEngine imports (NameError without TE): "
        "defined as None, so the router uses torch's matmul",
    ),
    *(Patch(name, why) for name, why, _ in _ON_CPU_TARGETS),
]

_APPLIED = False


def _resolve(spec: str) -> list[tuple[Any, str]]:
    import importlib

    out = []
    for part in spec.split(";"):
        module_name, attrs = part.split(":")
        module = importlib.import_module(module_name)
        for attr in attrs.split(","):
            owner: Any = module
            *path, last = attr.split(".")
            for p in path:
                owner = getattr(owner, p)
            out.append((owner, last))
    return out


def apply_cpu_patches() -> None:
    """Apply every patch of ``PATCHES`` (idempotent). Call in each rank before using megatron."""
    global _APPLIED
    if _APPLIED:
        return
    for message in (  # megatron's and torch's noise on this setup (no TE/Apex, CPU, gloo)
        ".*Transformer Engine and Apex are not installed.*",
        ".*Apex is not installed.*",
        ".*full scope is deprecated.*",
        ".*CUDA_DEVICE_MAX_CONNECTIONS.*",
        ".*is not a leaf Tensor is being accessed.*",
        ".*reduce_scatter_tensor. is deprecated.*",
        ".*all_gather_into_tensor. is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=message)
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.add = _tracker_add
    mrandom.CudaRNGStatesTracker.fork = _tracker_fork
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    for _name, _why, spec in _ON_CPU_TARGETS:
        for owner, attr in _resolve(spec):
            raw = vars(owner)[attr]  # the attribute as defined on that class / module (no inheritance)
            if isinstance(raw, classmethod):
                setattr(owner, attr, classmethod(_on_cpu(raw.__func__)))
            elif isinstance(raw, staticmethod):
                setattr(owner, attr, staticmethod(_on_cpu(raw.__func__)))
            else:
                setattr(owner, attr, _on_cpu(raw))
    _APPLIED = True


# ----------------------------------------------------------------------------------------------
# names and the seeded reference weights
# ----------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(?=\.)")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP wrapper (``chunk.module``)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def global_param_name(gpt: torch.nn.Module, local_name: str, sharded_keys: bool = False) -> str:
    """``decoder.layers.<i>.…`` (``i``: index in this chunk's ``decoder.layers``) renamed with the
    global layer number (``layer_number - 1``, counted across pipeline stages and virtual chunks).
    ``sharded_keys``: also apply the layer spec's ``sharded_state_dict_keys_map`` (the local spec
    maps ``input_layernorm.`` to ``self_attention.linear_qkv.layer_norm_`` and ``pre_mlp_layernorm.``
    to ``mlp.linear_fc1.layer_norm_``, TransformerEngine's names), giving the key that
    ``sharded_state_dict(metadata={'non_homogeneous_layers': True})`` uses."""
    m = _LAYER_RE.match(local_name)
    if m is None:
        return local_name
    layer = gpt.decoder.layers[int(m.group(1))]
    rest = local_name[m.end() :]
    e = _EXPERT_RE.match(rest)
    if e is not None:  # local expert index -> global (experts are split over EP ranks in order)
        from megatron.core import parallel_state as ps

        first = ps.get_expert_model_parallel_rank() * layer.mlp.experts.num_local_experts
        rest = f"{e.group(1)}{first + int(e.group(2))}{rest[e.end() :]}"
    if sharded_keys:
        for old, new in layer.submodules_config.sharded_state_dict_keys_map.items():
            if rest.startswith(old):
                rest = new + rest[len(old) :]
                break
    return f"decoder.layers.{layer.layer_number - 1}.{rest}"


def local_param_names(model_chunks: list[torch.nn.Module], sharded_keys: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of this rank's model chunks (parameters and persistent buffers: the tensors
    of ``state_dict()``) under its global name (see ``global_param_name``)."""
    out: dict[str, torch.Tensor] = {}
    for chunk in model_chunks:
        gpt = _unwrap(chunk)
        for name, value in gpt.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                continue  # ``_extra_state`` entries (None for the local layer spec)
            gname = global_param_name(gpt, name, sharded_keys)
            if gname in out:
                raise AssertionError(f"two local tensors named {gname}")
            out[gname] = value
    return out


def _tp_dim(t: torch.Tensor) -> int | None:
    """The dimension a tensor-parallel tensor is split along, None for a TP replica."""
    if not getattr(t, "tensor_model_parallel", False):
        return None
    if getattr(t, "partition_stride", 1) not in (1, 2):  # 2: SwiGLU's fc1, see gated_names
        raise NotImplementedError("strided tensor-parallel partitions are not handled")
    return int(t.partition_dim)


def _global_shape(t: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(t.shape)
    dim = _tp_dim(t)
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)


def reference_tensor(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The full (TP-unsplit) initial value of parameter ``name``: a function of ``seed``, the
    global name and the global shape only, so any TP x PP x DP layout builds the same model.
    Layer-norm weights around 1, every other tensor N(0, 0.02²) (biases too, so that shards
    of a bias differ)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    if "layernorm" in name and name.endswith(".weight"):
        return 1.0 + 0.1 * values
    return 0.02 * values


_GATED_RE = re.compile(r"linear_fc1\.(weight|bias)$")


def gated_names(model_chunks: list[torch.nn.Module], names: Any) -> set[str]:
    """The ``linear_fc1`` tensors of a SwiGLU model (``gated_linear_unit``): their full tensor is
    [gate; up] and each TP rank holds [its gate rows; its up rows]."""
    if not getattr(_unwrap(model_chunks[0]).config, "gated_linear_unit", False):
        return set()
    return {n for n in names if _GATED_RE.search(n)}


def _tp_slice(full: torch.Tensor, local: torch.Tensor, tp_rank: int, gated: bool = False) -> torch.Tensor:
    dim = _tp_dim(local)
    if dim is None:
        return full
    size = local.shape[dim]
    if gated:  # [gate; up] -> this rank's [gate rows; up rows]
        half = size // 2
        return torch.cat([h.narrow(dim, tp_rank * half, half) for h in full.chunk(2, dim=dim)], dim=dim)
    return full.narrow(dim, tp_rank * size, size)


@torch.no_grad()
def load_full_model_state(
    model_chunks: list[torch.nn.Module], full: dict[str, torch.Tensor], optimizer: Any = None
) -> None:
    """Copy this rank's TP slices of the full tensors ``full`` (names as ``full_model_state``
    gives them) into its chunks, at any layout. With ``optimizer``, its main params follow
    (``reload_model_params``: the fp32 copies of bf16 params; fp32 params are optimized in place,
    the distributed optimizer's shards being views of them)."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    names = local_param_names(model_chunks)
    gated = gated_names(model_chunks, names)
    for name, t in names.items():
        src = _tp_slice(full[name], t, tp_rank, name in gated)
        if tuple(src.shape) != tuple(t.shape):
            raise AssertionError(f"{name}: full slice {tuple(src.shape)} vs local {tuple(t.shape)}")
        t.data.copy_(src)
    if optimizer is not None:
        optimizer.reload_model_params()


@torch.no_grad()
def _seeded_init(model_chunks: list[torch.nn.Module], seed: int) -> None:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    names = local_param_names(model_chunks)
    gated = gated_names(model_chunks, names)
    for name, t in names.items():
        t.data.copy_(_tp_slice(reference_tensor(seed, name, _global_shape(t, tp)), t, tp_rank, name in gated))


# ----------------------------------------------------------------------------------------------
# building
# ----------------------------------------------------------------------------------------------


def _moe_config(num_moe_experts: int | None, ep: int) -> dict[str, Any]:
    """TransformerConfig fields of a MoE model: ``num_moe_experts`` SequentialMLP experts split
    over ``ep`` ranks, top-1 routing, all-gather token dispatch, no auxiliary loss."""
    if num_moe_experts is None:
        return {}
    return {
        "num_moe_experts": num_moe_experts,
        "expert_model_parallel_size": ep,
        "moe_router_topk": 1,
        "moe_router_pre_softmax": True,  # required with top-1
        "moe_token_dispatcher_type": "allgather",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_load_balancing_type": "none",
        # with biases, mlp.py adds the expert bias in place to the output of an autograd Function
        # that returns its input as-is at TP1 (RuntimeError: view modified inplace) in 0.16.1
        "add_bias_linear": False,
    }


def build_gpt(
    tp: int,
    pp: int,
    dp: int,
    *,
    seed: int,
    use_distributed_optimizer: bool,
    num_layers: int = 4,
    hidden: int = 32,
    heads: int = 4,
    vocab: int = 64,
    seq: int = 16,
    virtual_pp: int | None = None,
    megatron_init: bool = False,
    bf16: bool = False,
    num_moe_experts: int | None = None,
    ep: int = 1,
    gated: bool = False,
) -> tuple[list[torch.nn.Module], Any]:
    """Megatron's parallel state, a tiny GPTModel (one chunk per virtual stage, each in megatron's
    DDP wrapper) and megatron's Adam (``ChainedOptimizer`` around a ``DistributedOptimizer``, or
    around an ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` for fp32 / bf16), in an
    initialised gloo group of ``tp*pp*dp`` ranks. Returns ``(model_chunks, optimizer)``.

    The weights are ``reference_tensor(seed, global name, global shape)`` (layout-independent);
    ``megatron_init=True`` keeps megatron's own CPU initialisation instead, which depends on the
    pipeline split (see docs/notes/megatron-cpu.md). ``bf16``: bf16 parameters inside megatron's
    ``Float16Module`` (fp32 logits and loss), fp32 main params and grads in the optimizer."""
    apply_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    world = dist.get_world_size()
    if world != tp * pp * dp:
        raise ValueError(f"world size {world} != tp*pp*dp = {tp}*{pp}*{dp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_pp,
        expert_model_parallel_size=ep,
    )
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)

    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=4 * hidden,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_pp,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
        batch_p2p_comm=False,
        **_moe_config(num_moe_experts, ep),
        **({"gated_linear_unit": True, "activation_func": torch.nn.functional.silu} if gated else {}),
    )
    spec = get_gpt_layer_local_spec(num_experts=num_moe_experts, moe_grouped_gemm=False)
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(virtual_pp or 1):
        stage = vp_stage if virtual_pp is not None else None
        chunks.append(
            GPTModel(
                config,
                spec,
                vocab_size=vocab,
                max_sequence_length=seq,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=False,
                vp_stage=stage,
            )
        )
    if not megatron_init:
        _seeded_init(chunks, seed)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, chunk) for chunk in chunks]  # bf16 params, fp32 logits/loss

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    model_chunks = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)
    ]
    for chunk in model_chunks:
        chunk.broadcast_params()  # a no-op here (DP replicas are built identical), kept as a guard

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=1.0,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, model_chunks)

    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    no_sync = [chunk.no_sync for chunk in model_chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return model_chunks, optimizer


# ----------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------


def global_batch(step: int, vocab: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's ``GLOBAL_BATCH`` sequences: (tokens, next-token labels), both [GLOBAL_BATCH, seq]."""
    gen = torch.Generator().manual_seed(10_000 + step)
    ids = torch.randint(0, vocab, (GLOBAL_BATCH, seq + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def train_step(model_chunks: list[torch.nn.Module], optimizer: Any, step: int) -> float:
    """One forward/backward (megatron's schedule for this PP / virtual-PP layout, one sequence per
    micro-batch, ``GLOBAL_BATCH / dp`` micro-batches per DP rank) and one optimizer step. Returns
    the mean token loss of the whole global batch, on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gpt = _unwrap(model_chunks[0])
    vocab, seq = gpt.vocab_size, gpt.max_sequence_length
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if GLOBAL_BATCH % dp:
        raise ValueError(f"global batch {GLOBAL_BATCH} does not split over {dp} DP ranks")
    per_rank = GLOBAL_BATCH // dp
    tokens, labels = global_batch(step, vocab, seq)
    rows = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    micro = [(tokens[i : i + 1], labels[i : i + 1]) for i in rows]
    position_ids = torch.arange(seq).unsqueeze(0)
    attention_mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True: masked

    def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module) -> tuple[torch.Tensor, Callable[..., Any]]:
        tok, lab = next(data_iterator)
        out = model(tok, position_ids, attention_mask, labels=lab)

        def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

        return out, loss_func

    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    iterators: Any = [iter(micro) for _ in model_chunks]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=model_chunks,
        num_microbatches=per_rank,
        seq_length=seq,
        micro_batch_size=1,
        forward_only=False,
    )
    ok, _grad_norm, _ = optimizer.step()
    if not ok:
        raise AssertionError("megatron's optimizer step was skipped")

    # the loss lives on the last pipeline stage: sum there, broadcast over PP, average over DP
    total = torch.zeros(1, dtype=torch.float64)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        total += sum(float(d["loss"]) for d in losses)
    pp_group = ps.get_pipeline_model_parallel_group()
    last = dist.get_global_rank(pp_group, pp_group.size() - 1)
    dist.broadcast(total, src=last, group=pp_group)
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return float(total) / GLOBAL_BATCH


# ----------------------------------------------------------------------------------------------
# the oracle: full tensors under global names, with plain torch.distributed
# ----------------------------------------------------------------------------------------------


class _Piece(NamedTuple):
    """One rank's part of one tensor: TP rank / dim (None: a TP replica), the local (TP-shard)
    shape, the flat range [start, end) of the local shard it holds, and the values there."""

    tp_rank: int
    tp_dim: int | None
    local_shape: tuple[int, ...]
    start: int
    end: int
    values: dict[str, torch.Tensor]


def _assemble(
    pieces: dict[str, list[_Piece]], fields: list[str], gated: set[str] | frozenset[str] = frozenset()
) -> dict[str, dict[str, torch.Tensor]]:
    """Full tensors from every rank's pieces: the flat ranges of each TP shard must cover it once
    (copies held twice, by DP or TP replicas, must agree exactly), then TP shards concatenate
    (``gated`` tensors: gate halves, then up halves)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, plist in sorted(pieces.items()):
        dims = {p.tp_dim for p in plist}
        if len(dims) != 1:
            raise AssertionError(f"{name}: ranks disagree on the TP dimension {dims}")
        (dim,) = dims
        by_tp: dict[int, list[_Piece]] = {}
        for p in plist:
            by_tp.setdefault(p.tp_rank if dim is not None else 0, []).append(p)
        if dim is not None and sorted(by_tp) != list(range(len(by_tp))):
            raise AssertionError(f"{name}: TP shards {sorted(by_tp)}")
        full: dict[str, torch.Tensor] = {}
        for field in fields:
            shards = []
            for tp_rank in sorted(by_tp):
                group = by_tp[tp_rank]
                shape = group[0].local_shape
                numel = int(torch.Size(shape).numel())
                flat = torch.full((numel,), float("nan"), dtype=group[0].values[field].dtype)
                seen = torch.zeros(numel, dtype=torch.bool)
                for p in group:
                    if p.local_shape != shape:
                        raise AssertionError(f"{name}: local shapes {p.local_shape} vs {shape}")
                    part = p.values[field].reshape(-1)
                    again = seen[p.start : p.end]
                    if again.any() and not torch.equal(flat[p.start : p.end][again], part[again]):
                        raise AssertionError(f"{name}.{field}: replicas differ")
                    flat[p.start : p.end] = part
                    seen[p.start : p.end] = True
                if not seen.all():
                    raise AssertionError(f"{name}.{field}: {int((~seen).sum())} of {numel} elements on no rank")
                shards.append(flat.reshape(shape))
            if dim is not None and name in gated:
                halves = [t.chunk(2, dim=dim) for t in shards]
                shards = [h[0] for h in halves] + [h[1] for h in halves]
            full[field] = shards[0] if dim is None else torch.cat(shards, dim=dim)
        out[name] = full
    return out


def _gather_pieces(local: dict[str, list[_Piece]]) -> dict[str, list[_Piece]]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [(name, tuple(p)) for name, plist in local.items() for p in plist])
    merged: dict[str, list[_Piece]] = {}
    for rank_pieces in gathered:
        for name, p in rank_pieces:
            merged.setdefault(name, []).append(_Piece(*p))
    return merged


@torch.no_grad()
def full_model_state(model_chunks: list[torch.nn.Module], sharded_keys: bool = False) -> dict[str, torch.Tensor]:
    """The full model on every rank: every tensor of ``state_dict()`` (global layer numbers;
    ``sharded_keys``: named as ``sharded_state_dict`` keys them, see ``global_param_name``), TP
    shards concatenated along ``partition_dim``, pipeline stages merged, replicas checked equal."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    local = {
        name: [_Piece(tp_rank, _tp_dim(t), tuple(t.shape), 0, t.numel(), {"param": t.detach().clone()})]
        for name, t in local_param_names(model_chunks, sharded_keys).items()
    }
    gated = gated_names(model_chunks, local)
    return {name: f["param"] for name, f in _assemble(_gather_pieces(local), ["param"], gated).items()}


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(opt: Any) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """(model param, the inner torch optimizer's param for it, flat start, flat end) for each
    parameter this rank optimizes: the optimizer's param is the fp32 main param (a copy for
    bf16/fp16 params, the param itself for fp32 ones), and with the distributed optimizer the 1-D
    shard ``[start, end)`` of the flattened TP-local param (``param_range_map['param']``)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    out = []
    if isinstance(opt, DistributedOptimizer):
        groups = [*zip(opt.model_fp32_groups, opt.shard_fp32_groups)]
        groups += [*zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups)]
        for model_group, main_group in groups:
            for model_param, main in zip(model_group, main_group, strict=True):
                rng = opt._get_model_param_range_map(model_param)["param"]
                out.append((model_param, main, rng.start, rng.end))
    elif isinstance(opt, Float16OptimizerWithFloat16Params):
        groups = [*zip(opt.float16_groups, opt.fp32_from_float16_groups)]
        groups += [(g, g) for g in opt.fp32_from_fp32_groups]
        for model_group, main_group in groups:
            out += [(p, main, 0, p.numel()) for p, main in zip(model_group, main_group, strict=True)]
    else:  # FP32Optimizer: the torch optimizer steps the model params themselves
        out += [(p, p, 0, p.numel()) for group in opt.optimizer.param_groups for p in group["params"]]
    return out


@torch.no_grad()
def full_optimizer_state(
    model_chunks: list[torch.nn.Module], optimizer: Any, sharded_keys: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """Per global parameter name (``sharded_keys``: see ``global_param_name``), on every rank:
    Adam's ``exp_avg`` / ``exp_avg_sq`` and the fp32 ``main_param``, full shape (the
    parameter's, in fp32). With the distributed optimizer each
    DP rank holds the flat range ``param_range_map[param]['param']`` of each TP-local param it
    owns (its torch optimizer's params are 1-D shards ``param.view(-1)[start:end]``, or fp32 copies
    of them for bf16 params); the pieces are put back together here and must cover each param once."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    names = {id(t): name for name, t in local_param_names(model_chunks, sharded_keys).items()}
    fields = ["exp_avg", "exp_avg_sq", "main_param"]
    local: dict[str, list[_Piece]] = {}
    for opt in _inner_optimizers(optimizer):
        for model_param, main, start, end in _main_params(opt):
            st = opt.optimizer.state[main]
            values = {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"], "main_param": main}
            piece = _Piece(
                tp_rank,
                _tp_dim(model_param),
                tuple(model_param.shape),
                start,
                end,
                {f: v.detach().reshape(-1).float().clone() for f, v in values.items()},
            )
            local.setdefault(names[id(model_param)], []).append(piece)
    return _assemble(_gather_pieces(local), fields, gated_names(model_chunks, local))


# ----------------------------------------------------------------------------------------------
# megatron's own description of the model (sharded_state_dict) against the oracle
# ----------------------------------------------------------------------------------------------


def _check_sharded_tensors(
    values: list[Any], full: dict[str, torch.Tensor], num_layers: int, form: str, strip: str = ""
) -> tuple[int, list[str], list[tuple[str, str, tuple[int, ...], tuple[int, ...], int]]]:
    """Each ShardedTensor of ``values`` (its key minus the prefix ``strip``) against the full
    tensors ``full``: (how many checked, problems, this rank's main replicas)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica

    checked, problems, mains = 0, [], []
    for sh in values:
        if isinstance(sh, ShardedObject) or not isinstance(sh, ShardedTensor):
            continue  # ``_extra_state`` (None for the local spec), optimizer bookkeeping objects
        checked += 1
        key, prep = sh.key, sh.prepend_axis_num
        if not key.startswith(strip):
            problems.append(f"{form} {key}: not under {strip!r}")
            continue
        key = key[len(strip) :]
        if prep:
            if prep != 1 or not key.startswith("decoder.layers.") or sh.global_shape[0] != num_layers:
                problems.append(f"{form} {key}: prepend_axis_num {prep}, global_shape {sh.global_shape}")
                continue
            key = f"decoder.layers.{sh.global_offset[0]}.{key[len('decoder.layers.') :]}"
        ref = full.get(key)
        if ref is None:
            problems.append(f"{form} {sh.key}: no oracle tensor {key}")
            continue
        if tuple(sh.global_shape[prep:]) != tuple(ref.shape) or sh.flattened_range is not None:
            problems.append(f"{form} {key}: global_shape {sh.global_shape} vs {tuple(ref.shape)}")
            continue
        box = tuple(slice(o, o + n) for o, n in zip(sh.global_offset[prep:], sh.local_shape))
        if not torch.equal(ref[box], sh.data.to(ref.dtype)):
            problems.append(f"{form} {key}: data differs from the oracle at {sh.global_offset}")
        if is_main_replica(sh.replica_id):
            mains.append((form, sh.key, tuple(sh.global_offset), tuple(sh.global_shape), sh.data.numel()))
    return checked, problems, mains


def _tiling_problems(mains: list[Any]) -> tuple[int, list[str]]:
    """Over all ranks: every global tensor's main replicas (``replica_id`` all zeros) tile it once."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mains)
    problems: list[str] = []
    seen: dict[tuple[str, str], set[tuple[int, ...]]] = {}
    covered: dict[tuple[str, str], tuple[int, int]] = {}
    for rank_mains in gathered:
        for form, key, offset, shape, numel in rank_mains:
            offsets = seen.setdefault((form, key), set())
            if offset in offsets:
                problems.append(f"{form} {key}: two main replicas at {offset}")
            offsets.add(offset)
            have, total = covered.get((form, key), (0, int(torch.Size(shape).numel())))
            covered[(form, key)] = (have + numel, total)
    problems += [f"{f} {k}: main replicas cover {h} of {t}" for (f, k), (h, t) in sorted(covered.items()) if h != t]
    return len(covered), problems


@torch.no_grad()
def sharded_state_dict_report(model_chunks: list[torch.nn.Module], optimizer: Any = None) -> dict[str, Any]:
    """Check megatron's own descriptions against the oracle. The model: ``sharded_state_dict()``
    of every (unwrapped) chunk, in the default layer-stacked form and with
    ``non_homogeneous_layers=True``. With a distributed ``optimizer``: its
    ``sharded_state_dict(model_sd, metadata={'distrib_optim_sharding_type': 'fully_reshardable'})``
    (keys ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``). Each ShardedTensor's data
    must be the oracle's full tensor at ``global_offset`` (a prepended axis holding the global
    layer number), its ``global_shape`` the full shape, and over all ranks the main replicas
    (``replica_id`` all zeros) must tile every global tensor exactly once. Returns counts and a
    list of problems (every rank gets the same report)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    full = full_model_state(model_chunks, sharded_keys=True)
    num_layers = _unwrap(model_chunks[0]).config.num_layers
    problems: list[str] = []
    mains: list[Any] = []
    counts: dict[str, int] = {}
    forms = {"stacked": None, "per_layer": {"non_homogeneous_layers": True}}
    for form, metadata in forms.items():
        values = []
        for chunk in model_chunks:
            gpt = _unwrap(chunk)
            sd = gpt.sharded_state_dict(metadata=metadata) if metadata else gpt.sharded_state_dict()
            values += list(nested_values(sd))
        counts[form], more_problems, more_mains = _check_sharded_tensors(values, full, num_layers, form)
        problems += more_problems
        mains += more_mains
    if optimizer is not None:
        state = full_optimizer_state(model_chunks, optimizer, sharded_keys=True)
        model_sd = {f"model{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(model_chunks)}
        opt_sd = optimizer.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        param_state = list(nested_values(opt_sd["param_state"]))
        for field, ours in (("param", "main_param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            prefix = f"optimizer.state.{field}."
            mine = [v for v in param_state if getattr(v, "key", "").startswith(prefix)]
            full_field = {name: s[ours] for name, s in state.items()}
            form = f"optimizer.{field}"
            counts[form], more_problems, more_mains = _check_sharded_tensors(mine, full_field, num_layers, form, prefix)
            problems += more_problems
            mains += more_mains
    global_tensors, more_problems = _tiling_problems(mains)
    return {"counts": counts, "global_tensors": global_tensors, "problems": problems + more_problems}
