"""FSDP1 adapter (``FullyShardedDataParallel``): flat parameters decomposed into regular boxes.

FSDP1 flattens the parameters of each wrapped module into one ``FlatParameter`` and gives each
rank a contiguous 1-D slice of it (plus right padding). Such a slice is usually no box of any
original tensor, so this adapter splits every original parameter's local run into the few boxes
it covers (:func:`unickpt.planning.boxes.decompose_flat_range`) from FSDP's own shard metadata
(``flat_param._shard_param_infos``). Each box is a zero-copy view ``local_flat[a:b].view(lengths)``
of the live flat parameter (or flat optimizer state); padding is never saved. No collective, no
all-gather, no FSDP state-dict hook runs: this adapter only reads metadata and makes views.

Who calls what, in order (per rank; see ``frameworks.base``):
  save: ``api.save`` -> ``FSDP1Adapter.save_view(state)`` -> :func:`flat_layouts` (one
        :class:`FlatLayout` per FSDP module) -> items for original params (views of the flat
        param), persistent buffers and unmanaged params (full boxes), optimizer state (views of
        flat / per-param state, scalar ``step`` as a replicated full box per original param) and
        the ``optimizer`` JSON object (``module_state.optimizer_object``).
  load: ``api.load`` -> ``FSDP1Adapter.load_view(state, md)`` -> the same decomposition of the
        destination slices gives ``LoadItem`` views the engine fills in place; optimizer state
        comes from ``optim_state.OptimizerLoad`` with ``_FlatStateLayout`` (missing state is
        allocated like the flat shard or the original parameter's run, from the checkpoint's
        records) -> per-original-param ``step`` values are read first as probes and must agree
        (``validate``) -> ``apply`` copies them into the flat step and installs the state.
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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..errors import FrameworkError
from ..format.dtypes import dtype_name
from ..format.records import Metadata
from ..planning.boxes import decompose_flat_range
from ..planning.specs import LoadItem, SaveItem, Shape, ShardSpec
from .base import MODEL_PREFIX, OPTIM_PREFIX, LoadView, SaveView, register_framework
from .generic import module_of, optimizer_of
from .module_state import clean_fqn, items_for, names_of, optimizer_object, refuse_meta
from .optim_state import OptimizerLoad, read_saved

__all__ = ["FSDP1Adapter", "LocalPiece", "OrigParam", "FlatLayout", "local_pieces", "orig_param", "flat_layouts"]

Item = SaveItem | LoadItem
ItemT = TypeVar("ItemT", bound=Item)  # SaveItem on save, LoadItem on load


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
    """The local run of one original parameter from FSDP's ``_ShardParamInfo`` ``info`` (fields
    in_shard, offset_in_shard, numel_in_shard, intra_param_start_idx) for a local shard of
    ``sharded_numel`` elements (pure)."""
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


def _describe(
    key: str, shape: Shape, flat: torch.Tensor, start: int, pieces: list[LocalPiece], make: type[ItemT]
) -> Iterator[ItemT]:
    """Items for tensor ``key`` whose local run starts at ``flat[start]``: one view per box."""
    dtype = dtype_name(flat.dtype)
    if not pieces:
        box = _empty_box(shape)
        if box is not None:
            yield make(ShardSpec(key, dtype, shape, *box), flat[:0].view(box[1]))
        elif make is LoadItem:  # a 0-d tensor held by another rank: read it, then drop it
            yield make(ShardSpec(key, dtype, (), (), ()), flat.new_empty(()))
        return
    for pc in pieces:
        a = start + pc.local_start
        yield make(ShardSpec(key, dtype, shape, pc.offsets, pc.lengths), flat[a : a + pc.numel].view(pc.lengths))


def flat_layouts(model: nn.Module) -> list[FlatLayout]:
    """Every FSDP module's flat parameter with this rank's original-parameter runs (no I/O, no
    collectives: FSDP's per-rank ``_shard_param_infos`` already say which elements are local).

    FSDP1 points every flat parameter back at its local shard after each forward and backward
    (SHARD_GRAD_OP only keeps the unsharded storage allocated), so a flat parameter is unsharded
    only inside forward/backward or ``summon_full_params``, where the unsharded copy is the
    authoritative one: refused."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, FullyShardedDataParallel):
            continue
        handle = getattr(mod, "_handle", None)
        if handle is None:  # wraps no parameters of its own
            continue
        fp = handle.flat_param
        where = f"FSDP module {name or '<root>'!r}"
        sharded = int(math.prod(fp._sharded_size))
        if fp.numel() != sharded:
            raise FrameworkError(
                f"{where}: flat parameter holds {fp.numel()} elements, not its sharded size "
                f"{sharded} (unsharded: inside forward/backward or summon_full_params?); save "
                "and load between training steps"
            )
        prefix = f"{name}." if name else ""
        fqns = [clean_fqn(prefix + f, True) for f in fp._fqns]
        aliases: dict[str, list[str]] = {}
        for sp in fp._shared_param_infos:
            prim = ".".join(x for x in (sp.prim_module_name, sp.prim_param_name) if x)
            alias = ".".join(x for x in (sp.module_name, sp.param_name) if x)
            aliases.setdefault(clean_fqn(prefix + prim, True), []).append(clean_fqn(prefix + alias, True))
        params = [
            orig_param(fqn, tuple(int(d) for d in shape), info, sharded, tuple(aliases.get(fqn, ())))
            for fqn, shape, info in zip(fqns, fp._shapes, fp._shard_param_infos)
        ]
        orig = tuple(fp._params) if getattr(fp, "_params", None) is not None else None
        out.append(FlatLayout(name, fp, fp.detach(), tuple(params), orig))
    return out


class _Index:
    """Lookups from live parameters to layouts, built once per save_view / load_view."""

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
                # flat_param is a FlatParameter (typed nn.Parameter here, no torch.distributed import)
                managed.update(id(p) for p in lay.flat_param._shared_params or ())  # type: ignore[attr-defined]
        managed.update(self.orig)
        # parameters FSDP does not manage (ignored modules): plain, replicated tensors
        self.plain = [
            (clean_fqn(n, True), p)
            for n, p in model.named_parameters()
            if id(p) not in managed and not getattr(p, "_is_flat_param", False)
        ]
        self.buffers = [
            (clean_fqn(f"{m}.{b}" if m else b, True), t)
            for m, mod in model.named_modules()
            for b, t in mod._buffers.items()
            if t is not None and b not in mod._non_persistent_buffers_set
        ]
        self.names: dict[int, str | tuple[str, ...]] = {id(p): n for n, p in self.plain}
        for lay in self.layouts:
            self.names[id(lay.flat_param)] = tuple(op.fqn for op in lay.params)
        for key, (_, op) in self.orig.items():
            self.names[key] = op.fqn

    def model_items(self, make: type[ItemT]) -> list[ItemT]:
        items: list[ItemT] = []
        for lay in self.layouts:
            for op in lay.params:
                for fqn in (op.fqn, *op.aliases):
                    items.extend(
                        _describe(MODEL_PREFIX + fqn, op.shape, lay.local, op.shard_offset, lay.boxes(op), make)
                    )
        for fqn, t in self.plain:
            items.append(items_for(MODEL_PREFIX + fqn, t, make))
        for fqn, t in self.buffers:  # replicated: saved from rank 0 of the FSDP group
            items.append(items_for(MODEL_PREFIX + fqn, t, make, self.buffer_source))
        return items

    def state_items(
        self,
        p: torch.Tensor,
        key: str,
        v: torch.Tensor,
        make: type[ItemT],
        scalar: Callable[[str, torch.Tensor], ItemT],
    ) -> list[ItemT]:
        """Items of optimizer state ``key`` (tensor ``v``) of live parameter ``p``."""
        if id(p) in self.flat:  # use_orig_params=False: state laid out like the flat shard
            lay = self.flat[id(p)]
            if v.dim() == 0:
                return [scalar(f"{OPTIM_PREFIX}state.{op.fqn}.{key}", v) for op in lay.params]
            if tuple(v.shape) != tuple(lay.local.shape):
                raise FrameworkError(
                    f"optimizer state {key!r} of the flat parameter of FSDP module "
                    f"{lay.owner or '<root>'!r} ({', '.join(op.fqn for op in lay.params[:4])}...) "
                    f"has shape {tuple(v.shape)}; expected a scalar or the local shard {tuple(lay.local.shape)}"
                )
            flat = v.detach()
            return [
                it
                for op in lay.params
                for it in _describe(
                    f"{OPTIM_PREFIX}state.{op.fqn}.{key}", op.shape, flat, op.shard_offset, lay.boxes(op), make
                )
            ]
        name = f"{OPTIM_PREFIX}state.{self.names[id(p)]}.{key}"
        if id(p) in self.orig:  # use_orig_params=True: state shaped like the local view
            lay, op = self.orig[id(p)]
            if tuple(v.shape) == tuple(p.shape) and v.numel() == op.numel:
                if not v.is_contiguous():
                    raise FrameworkError(f"{name}: optimizer state tensor is not contiguous")
                return list(_describe(name, op.shape, v.detach().reshape(-1), 0, lay.boxes(op), make))
            if v.dim() == 0:
                return [make(ShardSpec(name, dtype_name(v.dtype), (), (), ()), v.detach())]
            raise FrameworkError(
                f"{name}: optimizer state of shape {tuple(v.shape)} fits neither parameter "
                f"{op.fqn!r}'s local run ({op.numel} elements) nor a scalar"
            )
        return [items_for(name, v, make)]


def _groups_params(optim: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for g in optim.param_groups:
        yield from g["params"]


def _check_optimizer(optim: torch.optim.Optimizer, index: _Index) -> None:
    for p in _groups_params(optim):
        if id(p) not in index.names:
            raise FrameworkError(
                "the optimizer holds a parameter that is neither an FSDP flat parameter, an original "
                f"parameter of one, nor a model parameter (shape {tuple(p.shape)})"
            )


class FSDP1Adapter:
    """``framework="fsdp"``: ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1)."""

    name = "fsdp"

    def matches(self, state: Mapping[str, Any]) -> bool:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = state.get("model")
        return isinstance(model, nn.Module) and any(isinstance(m, FullyShardedDataParallel) for m in model.modules())

    def _index(self, state: Mapping[str, Any]) -> tuple[_Index, torch.optim.Optimizer | None] | None:
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
        if optim is not None:
            _check_optimizer(optim, index)
        return index, optim

    def save_view(self, state: Mapping[str, Any]) -> SaveView:
        view = SaveView(items=[])
        got = self._index(state)
        if got is None:
            return view
        index, optim = got
        view.mesh = index.mesh
        with torch.no_grad():
            view.items.extend(index.model_items(SaveItem))
            refuse_meta(view.items, saving=True)
            if optim is None:
                return view
            values: dict[str, dict[str, Any]] = {}
            for p in _groups_params(optim):
                for key, v in optim.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        view.items.extend(
                            index.state_items(
                                p,
                                key,
                                v,
                                SaveItem,
                                lambda fqn, t: SaveItem(ShardSpec(fqn, dtype_name(t.dtype), (), (), ()), t.detach()),
                            )
                        )
                    else:
                        for n in names_of(index.names, p):
                            values.setdefault(n, {})[key] = v
            view.objects.update(optimizer_object(optim, index.names, values))
        return view

    def load_view(self, state: Mapping[str, Any], md: Metadata | None = None, strict: bool = True) -> LoadView:
        view = LoadView(items=[], prefixes=())
        got = self._index(state)
        if got is None:
            return view
        index, optim = got
        view.prefixes = (MODEL_PREFIX,)
        view.items.extend(index.model_items(LoadItem))
        refuse_meta(view.items, saving=False)
        if optim is None:
            return view
        load = OptimizerLoad(optim, _FlatStateLayout(index), read_saved(md), strict)
        view.items.extend(load.items)
        view.probes, view.validate, view.apply = load.probes, load.validate, load.apply
        view.prefixes = (MODEL_PREFIX, OPTIM_PREFIX)
        return view


class _FlatStateLayout:
    """``optim_state.StateLayout`` of FSDP1: state of a flat parameter (use_orig_params=False)
    is laid out like its padded local shard, one tensor for all its original parameters (a 0-d
    ``step`` is one value for all of them: read per original parameter into probes that must
    agree); state of an original parameter (use_orig_params=True) like its local 1-D run."""

    def __init__(self, index: _Index) -> None:
        self.index = index
        self.shapes = {id(lay.flat_param): {op.fqn: op.shape for op in lay.params} for lay in index.layouts}

    def fqns(self, p: torch.Tensor) -> tuple[str, ...]:
        return names_of(self.index.names, p)

    def param_shape(self, p: torch.Tensor, fqn: str) -> Shape:
        if id(p) in self.shapes:
            return self.shapes[id(p)][fqn]
        if id(p) in self.index.orig:
            return self.index.orig[id(p)][1].shape
        return tuple(p.shape)

    def like(self, p: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return p, id(p) in self.index.flat  # flat state has padding: zeroed

    def holds(self, p: torch.Tensor) -> bool:
        # use_orig_params=True: a rank without any element of an original parameter gets no
        # gradient for it, so torch's optimizers never give it state there
        return id(p) not in self.index.orig or self.index.orig[id(p)][1].numel > 0

    def describe(self, p: torch.Tensor, name: str, t: torch.Tensor) -> tuple[list[LoadItem], list[LoadItem]]:
        probes: list[LoadItem] = []

        def probe(fqn: str, like: torch.Tensor) -> LoadItem:
            item = LoadItem(ShardSpec(fqn, dtype_name(like.dtype), (), (), ()), torch.empty((), dtype=like.dtype), True)
            probes.append(item)
            return item

        items = self.index.state_items(p, name, t, LoadItem, probe)
        return [it for it in items if not any(it is q for q in probes)], probes


register_framework(FSDP1Adapter(), auto_priority=0)
