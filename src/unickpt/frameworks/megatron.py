"""``framework="megatron"``: megatron-core models (one chunk, or one per virtual pipeline stage)
and megatron's optimizers, the distributed optimizer (ZeRO-1 over DP) included.

The adapter translates megatron's own description of its state and nothing else:

* the model: ``sharded_state_dict(metadata={"non_homogeneous_layers": True})`` of every
  unwrapped chunk (inside megatron's DDP and ``Float16Module``). Each ``ShardedTensor`` names the
  global tensor (``key``: megatron's global name, layer numbers counted over all pipeline stages
  and virtual chunks, so a key is the same at every TP/PP/DP/VP split), its ``global_shape`` and
  the ``global_offset`` of this rank's local tensor (the parameter itself, or a view of it);
  ``prepend_axis_num`` leading axes (stacked layers or experts) the local tensor lacks become
  length-1 box axes. The checkpoint key is ``model.<key>`` and the box is the local tensor's.
  Replicas (TP-replicated layer norms, DP replicas) describe the same box on several ranks; the
  save planner writes each box once, from the least loaded holder (worst-fit), whatever
  megatron's ``replica_id`` says. ``ShardedTensorFactory`` entries (e.g. a gated ``linear_fc1``
  saved as two halves) are built and their parts described when they are views of the live
  tensor; ``ShardedObject`` entries without data (the local layer spec's ``_extra_state``) and
  ``LocalNonpersistentObject`` are skipped; anything else is refused by name.
* the optimizer: megatron's ``ChainedOptimizer`` (or one inner optimizer) wraps per parameter set
  a ``DistributedOptimizer``, ``FP32Optimizer`` or ``Float16OptimizerWithFloat16Params``, each
  around a torch optimizer whose parameters are the fp32 *main* parameters (a plain torch
  optimizer over the model's parameters is accepted too). unickpt reads and
  fills those torch optimizers directly (``param_groups`` and ``state``: the duck-typed contract
  of ``base``), one view over all of them. Each main parameter is mapped to the model parameter
  it trains and the flat range ``[start, end)`` of the TP-local tensor it covers (the
  distributed optimizer's ``param`` range, or the whole tensor); that range is decomposed into
  boxes of the global tensor (``planning.boxes.decompose_flat_range``, as for FSDP1), so state
  is stored per model tensor (``optimizer.state.<key>.exp_avg`` ...) and loads into any TP, PP,
  DP or VP split, with or without the distributed optimizer, without a gather at save.
* tensors megatron marks ``allow_shape_mismatch`` (word embeddings, output layer: the vocabulary
  is padded to a multiple of the TP size, so another TP size can give another row count) load
  from a checkpoint with another number of rows: the rows both have are loaded, padding rows
  the checkpoint lacks keep their values (their optimizer state starts at zero), saved padding
  rows the job lacks are not read.
* fp32 main parameters that are copies (bf16/fp16 models) are saved as
  ``optimizer.main_params.<key>``. A checkpoint without them (saved from an fp32 job) loads its
  model tensors and then sets the main parameters from them, as megatron's
  ``reload_model_params`` does.

Like every adapter it only describes (``describe``, through ``views.DescribedAdapter``), on every
rank: no I/O and no collectives here. megatron-core is imported only once the state holds its
objects. The mesh recorded is megatron's parallel sizes (information only: a load may use any).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..errors import FrameworkError
from ..format.dtypes import dtype_name
from ..format.records import Metadata
from ..planning.boxes import decompose_flat_range
from ..planning.specs import Shape, ShardSpec
from .base import (
    MODEL_PREFIX,
    OPTIM_PREFIX,
    STATE_PREFIX,
    LoadView,
    OptimizerDescription,
    Piece,
    Role,
    StateDescription,
    is_optimizer_like,
)
from .views import DescribedAdapter, load_view

__all__ = ["MegatronAdapter", "MAIN_PARAMS_PREFIX", "model_chunks", "is_megatron_module"]

MAIN_PARAMS_PREFIX = f"{OPTIM_PREFIX}main_params."  # + key: fp32 main copies of bf16/fp16 params


def is_megatron_module(obj: object) -> bool:
    """Whether ``obj`` is an ``nn.Module`` defined by megatron-core (a cheap class check that
    never imports megatron)."""
    return isinstance(obj, nn.Module) and any(c.__module__.startswith("megatron.core.") for c in type(obj).__mro__)


def model_chunks(model: object) -> list[nn.Module]:
    """``state["model"]`` as a list of chunks: one module, or a list/tuple of them (virtual
    pipeline stages)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise FrameworkError(
            'framework="megatron": state["model"] must be a megatron-core module or a list of them '
            f"(one per virtual pipeline stage), got {type(model).__name__}"
        )
    return chunks  # type: ignore[return-value]


def _unwrap(chunk: nn.Module) -> nn.Module:
    """The model inside megatron's DDP and ``Float16Module`` wrappers (their ``.module``)."""
    while isinstance(getattr(chunk, "module", None), nn.Module):
        chunk = chunk.module  # type: ignore[assignment]
    return chunk


# ------------------------------------------------------------------ the model


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where a local tensor sits in its global tensor: ``key``, ``global_shape``, the offsets
    of its element [0, ..., 0] on every global axis, and ``prepend`` leading global axes it lacks."""

    key: str
    global_shape: Shape
    offsets: Shape
    prepend: int
    local_shape: Shape
    rows: int | None = None  # a checkpoint with another number of rows on axis 0: boxes end there

    def clip(self, offsets: Shape, lengths: Shape) -> int:
        """How many of a box's rows on axis 0 exist in the checkpoint (all but for ``rows``)."""
        if self.rows is None:
            return lengths[0]
        return max(0, min(offsets[0] + lengths[0], self.rows) - offsets[0])

    def boxes(self, start: int, numel: int) -> Iterator[tuple[Shape, Shape, int, int]]:
        """(global offsets, lengths, first flat index relative to ``start``, numel) of the boxes
        tiling the local tensor's row-major elements ``[start, start + numel)`` (rows beyond
        ``rows`` left out: a box's first rows are its first elements)."""
        lead_off, lead_len = self.offsets[: self.prepend], (1,) * self.prepend
        base = self.offsets[self.prepend :]
        for p in decompose_flat_range(self.local_shape, start, numel):
            offs = lead_off + tuple(b + o for b, o in zip(base, p.offsets))
            lens = lead_len + tuple(p.lengths)
            keep = self.clip(offs, lens)
            if keep:
                lens = (keep, *lens[1:])
                yield offs, lens, p.flat_start - start, math.prod(lens)


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a live parameter's elements sit: one placement, or several for a parameter megatron
    saves in parts (a ``ShardedTensorFactory``, e.g. a SwiGLU ``linear_fc1`` as its two halves):
    each ``(placement, first flat element of the part in the parameter)``, parts contiguous."""

    parts: tuple[tuple[_Placement, int], ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(at.key for at, _ in self.parts))

    @property
    def shapes(self) -> tuple[Shape, ...]:
        first: dict[str, Shape] = {}
        for at, _ in self.parts:
            first.setdefault(at.key, at.global_shape)
        return tuple(first.values())

    @property
    def clipped(self) -> bool:
        return any(at.rows is not None for at, _ in self.parts)

    def boxes(self, start: int, numel: int) -> Iterator[tuple[_Placement, Shape, Shape, int, int]]:
        """(placement, global offsets, lengths, first flat index relative to ``start``, numel) of
        the boxes tiling the parameter's row-major elements ``[start, start + numel)``."""
        for at, first in self.parts:
            size = math.prod(at.local_shape)
            lo, hi = max(start, first), min(start + numel, first + size)
            if lo < hi:
                for offs, lens, a, n in at.boxes(lo - first, hi - lo):
                    yield at, offs, lens, lo - start + a, n


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, Mapping):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class _ModelIndex:
    """Every chunk's ``ShardedTensor``s as pieces, and the placement of each live parameter."""

    def __init__(self, chunks: list[nn.Module], md: Metadata | None = None) -> None:
        from megatron.core.dist_checkpointing.mapping import (
            LocalNonpersistentObject,
            ShardedObject,
            ShardedTensor,
            ShardedTensorFactory,
        )

        self.md = md
        self.pieces: list[Piece] = []
        self.layout: dict[int, _Layout] = {}  # id(live parameter / buffer) -> where it sits
        seen: dict[tuple[str, Shape], str] = {}
        for ci, chunk in enumerate(chunks):
            gpt = _unwrap(chunk)
            if not callable(getattr(gpt, "sharded_state_dict", None)):
                raise FrameworkError(
                    f"model chunk {ci} ({type(gpt).__name__}) has no sharded_state_dict(): not a megatron-core model"
                )
            live = {t.untyped_storage().data_ptr() for t in [*gpt.parameters(), *gpt.buffers()]}
            describe: Any = gpt.sharded_state_dict
            todo = deque(_leaves(describe(metadata={"non_homogeneous_layers": True})))
            while todo:
                leaf = todo.popleft()
                if isinstance(leaf, ShardedTensor):
                    self.layout[id(leaf.data)] = _Layout(((self._add(leaf, live, seen, ci), 0),))
                elif isinstance(leaf, ShardedTensorFactory):
                    self.layout[id(leaf.data)] = self._factory(leaf, live, seen, ci)
                elif isinstance(leaf, ShardedObject):
                    if leaf.data is not None:
                        raise FrameworkError(
                            f"{leaf.key}: megatron ShardedObject holding {type(leaf.data).__name__} (e.g. "
                            "TransformerEngine extra state) is not supported: unickpt saves tensors and JSON "
                            "values, never pickles; use the local (non-TE) layer spec"
                        )
                elif isinstance(leaf, LocalNonpersistentObject) or leaf is None:
                    continue
                else:
                    raise FrameworkError(
                        f"model chunk {ci}: sharded_state_dict() holds a {type(leaf).__name__}, which the "
                        "megatron adapter cannot describe"
                    )

    def _factory(self, factory: Any, live: set[int], seen: dict[tuple[str, Shape], str], chunk: int) -> _Layout:
        """The parts megatron saves a tensor as (built now), each a contiguous view of it."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        data = factory.data
        built = list(_leaves(factory.build()))
        parts, total = [], 0
        for part in built:
            if not (
                isinstance(part, ShardedTensor)
                and isinstance(part.data, torch.Tensor)
                and _shares_storage(part.data, data)
                and part.data.is_contiguous()
                and data.is_contiguous()
            ):
                raise FrameworkError(
                    f"{factory.key}: megatron builds it from parts that are not contiguous views of the live "
                    "tensor, so a load could not write it in place; not supported"
                )
            parts.append((self._add(part, live, seen, chunk), part.data.storage_offset() - data.storage_offset()))
            total += part.data.numel()
        if total != data.numel():
            raise FrameworkError(f"{factory.key}: megatron's parts hold {total} of its {data.numel()} elements")
        return _Layout(tuple(parts))

    def _add(self, sh: Any, live: set[int], seen: dict[tuple[str, Shape], str], chunk: int) -> _Placement:
        key = str(sh.key)
        if sh.flattened_range is not None:
            raise FrameworkError(f"{key}: ShardedTensor with a flattened_range is not supported")
        data = sh.data
        if not isinstance(data, torch.Tensor):
            raise FrameworkError(f"{key}: ShardedTensor data is a {type(data).__name__}, not a tensor")
        gshape, offsets, prepend = tuple(sh.global_shape), tuple(sh.global_offset), int(sh.prepend_axis_num)
        local = tuple(data.shape)
        lengths = (1,) * prepend + local
        if len(offsets) != len(gshape) or len(lengths) != len(gshape):
            raise FrameworkError(
                f"{key}: global shape {gshape}, offsets {offsets} and local shape {local} "
                f"(+{prepend} prepended axes) disagree in rank"
            )
        if data.untyped_storage().data_ptr() not in live:
            raise FrameworkError(
                f"{key}: megatron describes it with a tensor that is not a live parameter or buffer of "
                f"model chunk {chunk}, so a load could not write it in place"
            )
        where = (key, offsets)
        if where in seen:
            raise FrameworkError(
                f"{key}: described twice at offsets {offsets} (model chunks {seen[where]} and {chunk})"
            )
        seen[where] = str(chunk)
        try:
            view = data.detach().view(lengths)
        except RuntimeError as e:
            raise FrameworkError(f"{key}: local tensor cannot be viewed as its box {lengths}: {e}") from e
        at = _Placement(key, gshape, offsets, prepend, local)
        rows = self._saved_rows(sh, gshape)
        if rows is not None:
            at = replace(at, global_shape=(rows, *gshape[1:]), rows=rows)
        keep = at.clip(offsets, lengths)
        if keep:
            spec = ShardSpec(MODEL_PREFIX + key, dtype_name(data.dtype), at.global_shape, offsets, (keep, *lengths[1:]))
            self.pieces.append(Piece(spec, view[:keep]))
        return at

    def _saved_rows(self, sh: Any, gshape: Shape) -> int | None:
        """The checkpoint's row count of a tensor megatron lets differ on axis 0
        (``allow_shape_mismatch``: embeddings and output layer, whose vocabulary is padded to a
        multiple of the TP size); None when it is the same or the tensor is not such a one."""
        rec = None if self.md is None else self.md.tensors.get(MODEL_PREFIX + str(sh.key))
        if rec is None or not getattr(sh, "allow_shape_mismatch", False) or int(sh.prepend_axis_num):
            return None
        saved = tuple(rec.shape)
        if len(saved) != len(gshape) or saved[1:] != gshape[1:] or saved[0] == gshape[0]:
            return None
        return int(saved[0])


# ------------------------------------------------------------------ the optimizer


@dataclass(frozen=True, slots=True, eq=False)
class _MainParam:
    """One parameter of an inner torch optimizer: the fp32 ``main`` tensor that trains elements
    ``[start, end)`` of the flattened local ``model`` parameter (``main`` is 1-D for the
    distributed optimizer, the parameter's shape otherwise)."""

    model: torch.Tensor
    main: torch.Tensor
    start: int
    end: int

    @property
    def is_copy(self) -> bool:
        """The main parameter is a separate fp32 copy (bf16/fp16 models), not the model's data."""
        return not _shares_storage(self.main, self.model)


def _main_params(inner: Any) -> list[_MainParam]:
    """The main parameters of one of megatron's inner optimizers, paired with model parameters."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    out: list[_MainParam] = []
    if isinstance(inner, DistributedOptimizer):
        pairs = [*zip(inner.model_fp32_groups, inner.shard_fp32_groups)]
        pairs += [*zip(inner.model_float16_groups, inner.shard_fp32_from_float16_groups)]
        for models, mains in pairs:
            for model, main in zip(models, mains, strict=True):
                rng = inner._get_model_param_range_map(model)["param"]
                out.append(_MainParam(model, main, int(rng.start), int(rng.end)))
    elif isinstance(inner, Float16OptimizerWithFloat16Params):
        pairs = [*zip(inner.float16_groups, inner.fp32_from_float16_groups)]
        pairs += [(g, g) for g in inner.fp32_from_fp32_groups]
        for models, mains in pairs:
            out += [_MainParam(m, main, 0, m.numel()) for m, main in zip(models, mains, strict=True)]
    elif isinstance(inner, FP32Optimizer):
        out += [_MainParam(p, p, 0, p.numel()) for g in inner.optimizer.param_groups for p in g["params"]]
    elif is_optimizer_like(inner) and not hasattr(inner, "optimizer"):  # a torch optimizer on the model params
        out += [_MainParam(p, p, 0, p.numel()) for g in inner.param_groups for p in g["params"]]
    else:
        raise FrameworkError(
            f"framework='megatron' supports megatron's DistributedOptimizer, FP32Optimizer and "
            f"Float16OptimizerWithFloat16Params (inside a ChainedOptimizer or alone) and torch optimizers "
            f"over the model's parameters, got {type(inner).__name__}"
        )
    return out


@dataclass(frozen=True, eq=False)
class _RangeState:
    """``ParamState`` of one main parameter: its state tensors (like ``main``: 1-D over the
    range, or the local shape) are stored as boxes of the global tensor(s) of ``layout``."""

    layout: _Layout
    mp: _MainParam

    @property
    def fqns(self) -> tuple[str, ...]:
        return self.layout.keys

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return self.layout.shapes

    @property
    def holds(self) -> bool:
        return True  # the distributed optimizer gives a rank only the parameters it owns a range of

    def like(self) -> tuple[torch.Tensor, bool]:
        return self.mp.main, self.layout.clipped  # rows the checkpoint lacks start at zero

    def pieces(self, name: str, value: torch.Tensor) -> list[Piece]:
        keys = [f"{STATE_PREFIX}{k}.{name}" for k in self.layout.keys]
        if value.dim() == 0:  # one value; saved per key when megatron saves the tensor in parts
            one, dtype = value.detach(), dtype_name(value.dtype)
            role = Role.SHARED if len(keys) > 1 else Role.HELD
            return [Piece(ShardSpec(k, dtype, (), (), ()), one, role) for k in keys]
        if tuple(value.shape) != tuple(self.mp.main.shape):  # a load laid out the saved shape in full
            raise FrameworkError(
                f"{keys[0]}: the checkpoint's state has global shape {tuple(value.shape)}, but the live "
                f"parameter {self.layout.keys[0]!r} has global shape {self.layout.shapes[0]}: the model "
                "differs from the saved one"
            )
        return range_pieces(STATE_PREFIX, f".{name}", self.layout, self.mp, value)


def range_pieces(prefix: str, suffix: str, layout: _Layout, mp: _MainParam, value: torch.Tensor) -> list[Piece]:
    """Pieces of ``value`` (a tensor laid out like ``mp.main``) as boxes of the global tensors
    ``<prefix><key><suffix>`` of ``layout``."""
    if tuple(value.shape) != tuple(mp.main.shape):
        raise FrameworkError(
            f"{prefix}{layout.keys[0]}{suffix}: optimizer state of shape {tuple(value.shape)}; expected a "
            f"scalar or the main parameter's shape {tuple(mp.main.shape)}"
        )
    if not value.is_contiguous():
        raise FrameworkError(f"{prefix}{layout.keys[0]}{suffix}: optimizer state tensor is not contiguous")
    flat = value.detach().reshape(-1)
    dtype = dtype_name(value.dtype)
    return [
        Piece(ShardSpec(f"{prefix}{at.key}{suffix}", dtype, at.global_shape, offs, lens), flat[a : a + n].view(lens))
        for at, offs, lens, a, n in layout.boxes(mp.start, mp.end - mp.start)
    ]


class _ChainedState(MutableMapping[Any, Any]):
    """The state mappings of several torch optimizers as one (each parameter is in exactly one)."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers
        self.owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}

    def _of(self, p: Any) -> Any:
        o = self.owner.get(id(p))
        if o is None:
            raise KeyError(p)
        return o.state

    def __getitem__(self, p: Any) -> Any:
        return self._of(p)[p]

    def __setitem__(self, p: Any, value: Any) -> None:
        self._of(p)[p] = value

    def __delitem__(self, p: Any) -> None:
        del self._of(p)[p]

    def __iter__(self) -> Iterator[Any]:
        for o in self.optimizers:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self.optimizers)


# param-group keys megatron sets from the layout, not from training: ``is_expert_parallel`` is
# True for expert parameters only when EP > 1, so it differs between EP sizes for one parameter
LAYOUT_GROUP_KEYS = frozenset({"is_expert_parallel"})


class _GroupView(dict):  # type: ignore[type-arg]
    """One of megatron's param groups without its layout keys; hyper-parameters set at load
    (``group[key] = value``) are written through to megatron's group."""

    def __init__(self, group: dict[str, Any]) -> None:
        super().__init__((k, v) for k, v in group.items() if k not in LAYOUT_GROUP_KEYS)
        self.group = group

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.group[key] = value


class _ChainedTorchOptimizers:
    """The inner torch optimizers of a megatron optimizer as one optimizer-like object: their
    groups (views without layout keys, writing through) and their states."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.param_groups: list[dict[str, Any]] = [_GroupView(g) for o in optimizers for g in o.param_groups]
        self.state = _ChainedState(optimizers)
        classes = {type(o) for o in optimizers}
        if len(classes) == 1:
            self.defaults = optimizers[0].defaults


def _describe_optimizer(
    optim: Any, index: _ModelIndex
) -> tuple[OptimizerDescription, list[tuple[_Layout, _MainParam]]]:
    inners = list(getattr(optim, "chained_optimizers", [optim]))
    torch_opts, params, copies = [], {}, []
    for inner in inners:
        mains = _main_params(inner)
        torch_opts.append(getattr(inner, "optimizer", inner))
        for mp in mains:
            layout = index.layout.get(id(mp.model))
            if layout is None:
                raise FrameworkError(
                    f"the optimizer trains a parameter of shape {tuple(mp.model.shape)} that the model's "
                    "sharded_state_dict() does not describe (is it a parameter of state['model']?)"
                )
            params[id(mp.main)] = _RangeState(layout, mp)
            if mp.is_copy:
                copies.append((layout, mp))
    return OptimizerDescription(_ChainedTorchOptimizers(torch_opts), params), copies


def _main_pieces(copies: list[tuple[_Layout, _MainParam]]) -> list[Piece]:
    return [pc for layout, mp in copies for pc in range_pieces(MAIN_PARAMS_PREFIX, "", layout, mp, mp.main)]


def _mesh() -> tuple[tuple[str, int], ...]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return ()
    sizes = [
        ("tp", ps.get_tensor_model_parallel_world_size()),
        ("pp", ps.get_pipeline_model_parallel_world_size()),
        ("dp", ps.get_data_parallel_world_size()),
        ("cp", ps.get_context_parallel_world_size()),
        ("ep", ps.get_expert_model_parallel_world_size()),
    ]
    vp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vp:
        sizes.append(("vp", vp))
    return tuple((name, int(n)) for name, n in sizes)


@dataclass(frozen=True, eq=False)
class _Described:
    desc: StateDescription
    copies: list[tuple[_Layout, _MainParam]]


class MegatronAdapter(DescribedAdapter):
    """``framework="megatron"``: megatron-core model chunks and megatron's optimizers."""

    name = "megatron"

    def matches(self, state: Mapping[str, Any]) -> bool:
        model = state.get("model")
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        return bool(chunks) and all(is_megatron_module(c) for c in chunks)

    def _describe(self, state: Mapping[str, Any], md: Metadata | None = None) -> _Described | None:
        model = state.get("model")
        if model is None:
            return None
        index = _ModelIndex(model_chunks(model), md)
        optim = state.get("optimizer")
        if optim is None:
            return _Described(StateDescription(tuple(index.pieces), None, _mesh()), [])
        opt, copies = _describe_optimizer(optim, index)
        pieces = (*index.pieces, *_main_pieces(copies))
        return _Described(StateDescription(pieces, opt, _mesh()), copies)

    def describe(self, state: Mapping[str, Any]) -> StateDescription | None:
        d = self._describe(state)
        return None if d is None else d.desc

    def load_view(self, state: Mapping[str, Any], md: Metadata | None = None, strict: bool = True) -> LoadView:
        d = self._describe(state, md)
        if d is None or md is None or not d.copies:
            return load_view(None if d is None else d.desc, md, strict)
        missing = [
            (layout, mp)
            for layout, mp in d.copies
            if any(MAIN_PARAMS_PREFIX + k not in md.tensors for k in layout.keys)
        ]
        if not missing:
            return load_view(d.desc, md, strict)
        # saved from a job without main copies (fp32): the main params follow the loaded model
        drop = {MAIN_PARAMS_PREFIX + k for layout, _ in missing for k in layout.keys}
        desc = replace(d.desc, model=tuple(pc for pc in d.desc.model if pc.spec.fqn not in drop))
        view = load_view(desc, md, strict)
        apply = view.apply

        def apply_then_reload_main() -> None:
            apply()
            with torch.no_grad():
                for _, mp in missing:
                    mp.main.copy_(mp.model.detach().reshape(-1)[mp.start : mp.end].view(mp.main.shape))

        view.apply = apply_then_reload_main
        return view
