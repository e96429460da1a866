"""FSDP1 adapter (``FullyShardedDataParallel``): flat parameters decomposed into regular boxes.

FSDP1 flattens the parameters of each wrapped module into one ``FlatParameter`` and gives each
rank a contiguous 1-D slice of it (plus right padding). Such a slice is usually no box of any
original tensor, so this adapter splits every original parameter's local run into the few boxes
it covers (:func:`unickpt.planning.boxes.decompose_flat_range`) from FSDP's own shard metadata
(``flat_param._shard_param_infos``, read like every private FSDP attribute through
``_fsdp_internals``). Each box is a zero-copy view ``local_flat[a:b].view(lengths)``
of the live flat parameter (or flat optimizer state); padding is never saved. No collective, no
all-gather, no FSDP state-dict hook runs: this adapter only reads metadata and makes views.

Order of use (per rank; see ``frameworks.base``): ``save_view`` and ``load_view``
(``views``) both start from ``FSDP1Adapter.describe(state)``: :func:`flat_layouts` (one
:class:`FlatLayout` per FSDP module) -> ``_Index`` -> pieces of original params (views of the
flat param), persistent buffers and unmanaged params (full boxes), and one ``ParamState`` per
optimizer parameter: ``_FlatState`` (use_orig_params=False: state laid out like the flat shard,
a 0-d ``step`` SHARED by all its original params), ``_OrigState`` (use_orig_params=True: state
laid out like the original param's local run) or ``TensorState`` (unmanaged params).
  save: the pieces are saved; state tensors are split by their ``ParamState``; the ``optimizer``
        JSON object is written per original param.
  load: the same pieces are the destinations the engine fills in place; missing optimizer state
        is allocated like the flat shard or the original parameter's run (``optim_state``);
        SHARED ``step`` values are read first as probes and must agree (``validate``) ->
        ``apply`` copies them into the flat step and installs the state.
Keys are the canonical ones of every adapter (``model.<fqn>``, ``optimizer.state.<fqn>.<name>``),
so FSDP1 checkpoints load into torch / ddp / fsdp2 and back. Supports ``use_orig_params`` True
and False, FULL_SHARD / SHARD_GRAD_OP / NO_SHARD (every rank then holds identical boxes: replicas,
written once), nested wrapping, tied parameters (saved under every name, like ``state_dict``)
and parameters of ignored modules (plain, replicated). Save and load only between training
steps (flat parameters sharded). A flat parameter keeps one ``step`` for all its original
parameters: loading differing per-parameter values into it is refused.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import FrameworkError
from ..format.dtypes import dtype_name
from ..planning.boxes import decompose_flat_range
from ..planning.specs import Shape, ShardSpec
from . import _fsdp_internals as internals
from .base import MODEL_PREFIX, STATE_PREFIX, OptimizerDescription, ParamState, Piece, Role, StateDescription
from .module_state import TensorState, clean_fqn, module_of, optimizer_of, tensor_piece
from .views import DescribedAdapter

__all__ = ["FSDP1Adapter", "LocalPiece", "OrigParam", "FlatLayout", "local_pieces", "orig_param", "flat_layouts"]


@dataclass(frozen=True, slots=True)
class LocalPiece:
    """One regular box of an original parameter and where its elements sit in a local flat run."""

    offsets: Shape  # box offsets in the original (global) tensor
    lengths: Shape  # box lengths
    local_start: int  # index of the box's first element in the local flat tensor
    numel: int


@dataclass(frozen=True, slots=True)
class OrigParam:
    """The local part of one original parameter inside its flat parameter's local shard.

    ``numel`` elements starting at row-major index ``param_start`` of the original tensor live at
    ``local_flat[shard_offset : shard_offset + numel]`` (``numel == 0``: none on this rank)."""

    fqn: str  # clean fqn of the original parameter
    shape: Shape
    shard_offset: int
    param_start: int
    numel: int
    aliases: tuple[str, ...] = ()  # clean fqns of tied parameters sharing this one's data


@dataclass(frozen=True, slots=True, eq=False)
class FlatLayout:
    """One FSDP module's flat parameter on this rank: its local shard and original params."""

    owner: str  # the FSDP module's name in the model ("" for the root), for messages
    flat_param: nn.Parameter
    local: torch.Tensor  # the local shard (with padding), a detached view of ``flat_param``
    params: tuple[OrigParam, ...]
    orig_params: tuple[nn.Parameter, ...] | None  # use_orig_params=True: the original variables
    pieces: dict[str, list[LocalPiece]] = field(default_factory=dict)  # fqn -> boxes (cache)

    def boxes(self, op: OrigParam) -> list[LocalPiece]:
        """The boxes of ``op``'s local run, ``local_start`` relative to the run's first element."""
        got = self.pieces.get(op.fqn)
        if got is None:
            got = self.pieces[op.fqn] = local_pieces(op.shape, op.param_start, op.numel)
        return got


def local_pieces(shape: Shape, param_start: int, numel: int) -> list[LocalPiece]:
    """Boxes tiling elements ``[param_start, param_start + numel)`` (row-major) of a ``shape``
    tensor, with positions relative to ``param_start`` (pure; see ``decompose_flat_range``)."""
    return [
        LocalPiece(p.offsets, p.lengths, p.flat_start - param_start, p.numel)
        for p in decompose_flat_range(tuple(shape), param_start, numel)
    ]


def orig_param(fqn: str, shape: Shape, info: Any, sharded_numel: int, aliases: tuple[str, ...] = ()) -> OrigParam:
    """The local run of one original parameter from ``info`` (``_fsdp_internals.ShardRun`` or
    FSDP's ``_ShardParamInfo``: fields in_shard, offset_in_shard, numel_in_shard,
    intra_param_start_idx) for a local shard of ``sharded_numel`` elements (pure)."""
    if not info.in_shard:
        return OrigParam(fqn, shape, 0, 0, 0, aliases)
    run = (int(info.offset_in_shard), int(info.intra_param_start_idx), int(info.numel_in_shard))
    if min(run) < 0 or run[0] + run[2] > sharded_numel or run[1] + run[2] > math.prod(shape):
        raise FrameworkError(
            f"parameter {fqn!r}: FSDP shard info {info} does not fit its shape {shape} "
            f"and the local shard of {sharded_numel} elements"
        )
    return OrigParam(fqn, shape, *run, aliases)


def _empty_box(shape: Shape) -> tuple[Shape, Shape] | None:
    """An empty box of a tensor (so a rank holding none of it still names it), None for 0-d."""
    if not shape:
        return None
    return (0,) * len(shape), (0,) + tuple(shape[1:])


def _flat_pieces(key: str, shape: Shape, flat: torch.Tensor, start: int, pieces: list[LocalPiece]) -> Iterator[Piece]:
    """Pieces of tensor ``key`` whose local run starts at ``flat[start]``: one view per box (a
    rank holding none of it: an empty box, or for a 0-d tensor an ELSEWHERE piece)."""
    dtype = dtype_name(flat.dtype)
    if not pieces:
        box = _empty_box(shape)
        if box is not None:
            yield Piece(ShardSpec(key, dtype, shape, *box), flat[:0].view(box[1]))
        else:
            yield Piece(ShardSpec(key, dtype, (), (), ()), flat[:0], Role.ELSEWHERE)
        return
    for pc in pieces:
        a = start + pc.local_start
        yield Piece(ShardSpec(key, dtype, shape, pc.offsets, pc.lengths), flat[a : a + pc.numel].view(pc.lengths))


def flat_layouts(model: nn.Module) -> list[FlatLayout]:
    """Every FSDP module's flat parameter with this rank's original-parameter runs (no I/O, no
    collectives: FSDP's per-rank shard metadata already says which elements are local; read
    through ``_fsdp_internals``).

    FSDP1 points every flat parameter back at its local shard after each forward and backward
    (SHARD_GRAD_OP only keeps the unsharded storage allocated), so a flat parameter is unsharded
    only inside forward/backward or ``summon_full_params``, where the unsharded copy is the
    authoritative one: refused."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, FullyShardedDataParallel):
            continue
        fp = internals.flat_param_of(mod)
        if fp is None:  # wraps no parameters of its own
            continue
        sharded = internals.sharded_numel(fp)
        if fp.numel() != sharded:
            raise FrameworkError(
                f"FSDP module {name or '<root>'!r}: flat parameter holds {fp.numel()} elements, not its sharded "
                f"size {sharded} (unsharded: inside forward/backward or summon_full_params?); save "
                "and load between training steps"
            )
        prefix = f"{name}." if name else ""
        aliases: dict[str, list[str]] = {}
        for prim, alias in internals.shared_aliases(fp):
            aliases.setdefault(clean_fqn(prefix + prim, True), []).append(clean_fqn(prefix + alias, True))
        params = []
        for rel, shape, run in zip(internals.orig_fqns(fp), internals.orig_shapes(fp), internals.shard_runs(fp)):
            fqn = clean_fqn(prefix + rel, True)
            params.append(orig_param(fqn, shape, run, sharded, tuple(aliases.get(fqn, ()))))
        out.append(FlatLayout(name, fp, fp.detach(), tuple(params), internals.orig_params(fp)))
    return out


def fsdp_package() -> Any | None:
    """``torch.distributed.fsdp`` where this process has imported it, else None: then no module
    is wrapped by FSDP1 or FSDP2 (``fully_shard``, also reached through
    ``torch.distributed._composable.fsdp``, imports it), and the framework's detection skips
    importing it (0.05-0.5 s of a plain model's first save or load: DDP, one process)."""
    return sys.modules.get("torch.distributed.fsdp")


def holds_fsdp1(model: nn.Module) -> bool:
    """Whether ``model`` holds an FSDP1 module (``FullyShardedDataParallel``)."""
    fsdp = fsdp_package()
    return fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel) for m in model.modules())


class _Index:
    """Lookups from live parameters to layouts, built once per ``describe``."""

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        self.layouts = flat_layouts(model)
        fsdp = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
        self.mesh: tuple[tuple[str, int], ...] = (("shard", int(fsdp[0].world_size)),) if fsdp else ()
        self.buffer_source = int(dist.get_process_group_ranks(fsdp[0].process_group)[0]) if fsdp else None
        self.flat: dict[int, FlatLayout] = {id(lay.flat_param): lay for lay in self.layouts}
        self.orig: dict[int, tuple[FlatLayout, OrigParam]] = {}
        managed = set(self.flat)
        for lay in self.layouts:
            if lay.orig_params is not None:
                for p, op in zip(lay.orig_params, lay.params):
                    self.orig[id(p)] = (lay, op)
                managed.update(id(p) for p in internals.shared_params(lay.flat_param))
        managed.update(self.orig)
        # parameters FSDP does not manage (ignored modules): plain, replicated tensors
        self.plain = [
            (clean_fqn(n, True), p)
            for n, p in model.named_parameters()
            if id(p) not in managed and not internals.is_flat_param(p)
        ]
        self.buffers = [(clean_fqn(n, True), t) for n, t in internals.persistent_buffers(model)]
        self.names: dict[int, str] = {id(p): n for n, p in self.plain}

    def model_pieces(self) -> list[Piece]:
        """Original parameters (views of the flat shards, under every tied name), unmanaged
        parameters and persistent buffers (full boxes; buffers saved from rank 0 of the group)."""
        out: list[Piece] = []
        for lay in self.layouts:
            for op in lay.params:
                for fqn in (op.fqn, *op.aliases):
                    out.extend(_flat_pieces(MODEL_PREFIX + fqn, op.shape, lay.local, op.shard_offset, lay.boxes(op)))
        out.extend(tensor_piece(MODEL_PREFIX + fqn, t) for fqn, t in self.plain)
        out.extend(tensor_piece(MODEL_PREFIX + fqn, t, self.buffer_source) for fqn, t in self.buffers)
        return out

    def param_state(self, p: torch.Tensor) -> ParamState:
        """The layout of optimizer parameter ``p``'s state."""
        if id(p) in self.flat:
            return _FlatState(self.flat[id(p)])
        if id(p) in self.orig:
            lay, op = self.orig[id(p)]
            return _OrigState(lay, op, p)
        if id(p) in self.names:
            return TensorState(self.names[id(p)], p)
        raise FrameworkError(
            "the optimizer holds a parameter that is neither an FSDP flat parameter, an original "
            f"parameter of one, nor a model parameter (shape {tuple(p.shape)})"
        )


@dataclass(frozen=True, eq=False)
class _FlatState:
    """State of a flat parameter (use_orig_params=False): laid out like its padded local shard,
    one tensor for all its original parameters; a 0-d state (``step``) is one value for all of
    them (SHARED: saved per original parameter, loaded into probes that must agree)."""

    lay: FlatLayout

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(op.fqn for op in self.lay.params)

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return tuple(op.shape for op in self.lay.params)

    @property
    def holds(self) -> bool:
        return True

    def like(self) -> tuple[torch.Tensor, bool]:
        return self.lay.flat_param, True  # flat state has padding: zeroed

    def pieces(self, name: str, value: torch.Tensor) -> list[Piece]:
        lay = self.lay
        if value.dim() == 0:
            one, dtype = value.detach(), dtype_name(value.dtype)  # one tensor object: one SHARED group
            return [
                Piece(ShardSpec(f"{STATE_PREFIX}{op.fqn}.{name}", dtype, (), (), ()), one, Role.SHARED)
                for op in lay.params
            ]
        if tuple(value.shape) != tuple(lay.local.shape):
            raise FrameworkError(
                f"optimizer state {name!r} of the flat parameter of FSDP module "
                f"{lay.owner or '<root>'!r} ({', '.join(op.fqn for op in lay.params[:4])}...) "
                f"has shape {tuple(value.shape)}; expected a scalar or the local shard {tuple(lay.local.shape)}"
            )
        flat = value.detach()
        return [
            pc
            for op in lay.params
            for pc in _flat_pieces(f"{STATE_PREFIX}{op.fqn}.{name}", op.shape, flat, op.shard_offset, lay.boxes(op))
        ]


@dataclass(frozen=True, eq=False)
class _OrigState:
    """State of an original parameter (use_orig_params=True): laid out like its local 1-D run.
    A rank without any element of it gets no gradient, so torch's optimizers never give it
    state there (``holds`` False)."""

    lay: FlatLayout
    op: OrigParam
    param: torch.Tensor

    @property
    def fqns(self) -> tuple[str, ...]:
        return (self.op.fqn,)

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return (self.op.shape,)

    @property
    def holds(self) -> bool:
        return self.op.numel > 0

    def like(self) -> tuple[torch.Tensor, bool]:
        return self.param, False

    def pieces(self, name: str, value: torch.Tensor) -> list[Piece]:
        key = f"{STATE_PREFIX}{self.op.fqn}.{name}"
        if tuple(value.shape) == tuple(self.param.shape) and value.numel() == self.op.numel:
            if not value.is_contiguous():
                raise FrameworkError(f"{key}: optimizer state tensor is not contiguous")
            return list(_flat_pieces(key, self.op.shape, value.detach().reshape(-1), 0, self.lay.boxes(self.op)))
        if value.dim() == 0:
            return [Piece(ShardSpec(key, dtype_name(value.dtype), (), (), ()), value.detach())]
        raise FrameworkError(
            f"{key}: optimizer state of shape {tuple(value.shape)} fits neither parameter "
            f"{self.op.fqn!r}'s local run ({self.op.numel} elements) nor a scalar"
        )


class FSDP1Adapter(DescribedAdapter):
    """``framework="fsdp"``: ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1)."""

    name = "fsdp"

    def matches(self, state: Mapping[str, Any]) -> bool:
        model = state.get("model")
        return isinstance(model, nn.Module) and holds_fsdp1(model)

    def describe(self, state: Mapping[str, Any]) -> StateDescription | None:
        model = module_of(state)
        optim = optimizer_of(state)
        if model is None:
            return None
        if not self.matches(state):
            raise FrameworkError(
                "framework='fsdp' needs a model wrapped in FullyShardedDataParallel "
                "(FSDP1); for fully_shard use framework='fsdp2'"
            )
        index = _Index(model)
        opt = None
        if optim is not None:
            params = {id(p): index.param_state(p) for g in optim.param_groups for p in g["params"]}
            opt = OptimizerDescription(optim, params)
        return StateDescription(tuple(index.model_pieces()), opt, index.mesh)
