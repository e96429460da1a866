"""Every private torch attribute unickpt's FSDP support reads, in one place.

torch has no public API for what an FSDP1 rank holds without a collective (FSDP1's own state
dict hooks all-gather), so the FSDP1 adapter (``frameworks.fsdp1``) reads FSDP's per-rank
metadata directly. Each accessor below reads one private attribute, checks it has the type
unickpt expects, and turns an absent or changed attribute into a ``FrameworkError`` that names
it and the installed torch version, instead of an ``AttributeError`` deep in an adapter (or,
worse, a silent fallback).

tests/unit/frameworks/test_fsdp_internals.py builds real FSDP1 and FSDP2 modules (gloo, 2 ranks) and
checks every accessor against what unickpt expects (types, shapes, invariants), so a torch
release that renames or changes one of them fails there, loudly, naming the attribute.

What is read, and why (FSDP1 = ``FullyShardedDataParallel``; "flat" = its ``FlatParameter``):
  ``FSDP._handle``                      the module's ``FlatParamHandle`` (None: no parameters of its own)
  ``FlatParamHandle.flat_param``        the module's flat parameter
  ``flat._sharded_size``                the padded size of the local shard (sharded state check)
  ``flat._fqns``, ``flat._shapes``      each original parameter's name (relative) and shape
  ``flat._shard_param_infos``           per original parameter: which run of it this rank holds
                                        (``in_shard``, ``offset_in_shard``, ``numel_in_shard``,
                                        ``intra_param_start_idx``)
  ``flat._shared_param_infos``          tied parameters: (``prim_module_name``, ``prim_param_name``,
                                        ``module_name``, ``param_name``)
  ``flat._params``, ``flat._shared_params``  the original parameter variables (use_orig_params=True)
  ``param._is_flat_param``              marks a FlatParameter (FSDP's own isinstance check reads it)
  ``nn.Module._buffers``, ``nn.Module._non_persistent_buffers_set``  persistent buffers without
                                        running FSDP's state-dict hooks (which all-gather)
  ``DTensor.__create_chunk_list__()``   the box of a DTensor's local shard (FSDP2, TP, FSDP2+TP;
                                        the protocol torch's own distributed checkpoint uses), or
                                        what it computes, ``tensor._utils.compute_local_shape_and_global_offset``,
                                        without the import of torch.distributed.checkpoint it makes
  ``DTensor._local_tensor``             the local shard itself (what ``to_local()`` returns
                                        outside autograd, minus the view it makes for parameters:
                                        ~1 us a tensor at describe); ``to_local()`` when absent
  ``WRAPPER_SEGMENTS``                  the private attribute names torch's wrappers insert into
                                        parameter names (FSDP1, torch.compile, activation
                                        checkpointing); ``module_state.clean_fqn`` drops them
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import FrameworkError

__all__ = [
    "WRAPPER_SEGMENTS",
    "ShardRun",
    "handle_of",
    "flat_param_of",
    "sharded_numel",
    "orig_fqns",
    "orig_shapes",
    "shard_runs",
    "shared_aliases",
    "orig_params",
    "shared_params",
    "is_flat_param",
    "persistent_buffers",
    "dtensor_local_box",
    "dtensor_local",
]

Shape = tuple[int, ...]

_LOCAL_SHAPE_AND_OFFSET: Any = None  # what DTensor.__create_chunk_list__ returns for a plain local shard
try:  # (``dtensor_local_box``); another torch release: the method itself
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as _LOCAL_SHAPE_AND_OFFSET
except ImportError:
    pass

# name segments torch's wrappers add to parameter fqns: FSDP1 (``_fsdp_wrapped_module``),
# torch.compile's OptimizedModule (``_orig_mod``), checkpoint_wrapper (``_checkpoint_wrapped_module``)
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")


@dataclass(frozen=True, slots=True)
class ShardRun:
    """FSDP's ``_ShardParamInfo`` of one original parameter, as plain ints: this rank's local
    shard holds elements ``[intra_param_start_idx, intra_param_start_idx + numel_in_shard)``
    (row-major) of the parameter at ``flat[offset_in_shard : offset_in_shard + numel_in_shard]``
    (``in_shard`` False: none of it; the other fields are then 0)."""

    in_shard: bool
    offset_in_shard: int
    numel_in_shard: int
    intra_param_start_idx: int


def _changed(owner: str, attr: str, what: str) -> FrameworkError:
    return FrameworkError(
        f"torch {torch.__version__}: {owner}.{attr} {what}; unickpt reads this private FSDP attribute "
        "(unickpt/frameworks/_fsdp_internals.py) and does not support this torch release yet"
    )


def _read(obj: Any, attr: str, owner: str) -> Any:
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise _changed(owner, attr, "does not exist") from None


def _ints(value: Any, owner: str, attr: str) -> Shape:
    if not isinstance(value, Sequence) or not all(isinstance(d, int) for d in value):
        raise _changed(owner, attr, f"is {type(value).__name__}, not a sequence of ints")
    return tuple(int(d) for d in value)


def handle_of(module: nn.Module) -> Any | None:
    """``module._handle`` of an FSDP1 module: its FlatParamHandle, None when it wraps no
    parameters of its own."""
    return _read(module, "_handle", "FullyShardedDataParallel")


def flat_param_of(module: nn.Module) -> nn.Parameter | None:
    """The FlatParameter of FSDP1 module ``module`` (None: it wraps no parameters of its own)."""
    handle = handle_of(module)
    if handle is None:
        return None
    fp = _read(handle, "flat_param", "FlatParamHandle")
    if not isinstance(fp, nn.Parameter) or not is_flat_param(fp):
        raise _changed("FlatParamHandle", "flat_param", f"is {type(fp).__name__}, not a FlatParameter")
    return fp


def sharded_numel(fp: nn.Parameter) -> int:
    """Elements of the local shard, padding included (``fp._sharded_size``); a sharded flat
    parameter holds exactly these (an unsharded one, inside forward/backward, more)."""
    return math.prod(_ints(_read(fp, "_sharded_size", "FlatParameter"), "FlatParameter", "_sharded_size"))


def orig_fqns(fp: nn.Parameter) -> tuple[str, ...]:
    """Each original parameter's name relative to the FSDP module (``fp._fqns``)."""
    fqns = _read(fp, "_fqns", "FlatParameter")
    if not isinstance(fqns, Sequence) or not all(isinstance(f, str) for f in fqns):
        raise _changed("FlatParameter", "_fqns", "is not a sequence of str")
    return tuple(fqns)


def orig_shapes(fp: nn.Parameter) -> tuple[Shape, ...]:
    """Each original parameter's shape (``fp._shapes``), in ``orig_fqns`` order."""
    shapes = _read(fp, "_shapes", "FlatParameter")
    if not isinstance(shapes, Sequence):
        raise _changed("FlatParameter", "_shapes", f"is {type(shapes).__name__}, not a sequence of shapes")
    return tuple(_ints(s, "FlatParameter", "_shapes") for s in shapes)


def shard_runs(fp: nn.Parameter) -> tuple[ShardRun, ...]:
    """This rank's run of each original parameter (``fp._shard_param_infos``), in ``orig_fqns``
    order."""
    infos = _read(fp, "_shard_param_infos", "FlatParameter")
    if not isinstance(infos, Sequence):
        raise _changed("FlatParameter", "_shard_param_infos", f"is {type(infos).__name__}, not a sequence")
    out = []
    for info in infos:
        fields = [
            _read(info, f, "_ShardParamInfo")
            for f in ("in_shard", "offset_in_shard", "numel_in_shard", "intra_param_start_idx")
        ]
        if not isinstance(fields[0], bool) or not all(v is None or isinstance(v, int) for v in fields[1:]):
            raise _changed("_ShardParamInfo", "fields", f"have unexpected types: {info!r}")
        if fields[0] and any(v is None for v in fields[1:]):
            raise _changed("_ShardParamInfo", "fields", f"are None for a parameter in the shard: {info!r}")
        out.append(ShardRun(fields[0], *(int(v) if fields[0] else 0 for v in fields[1:])))
    return tuple(out)


def shared_aliases(fp: nn.Parameter) -> tuple[tuple[str, str], ...]:
    """Tied parameters of ``fp``: (primary name, alias name), both relative to the FSDP module
    (``fp._shared_param_infos``); the alias shares the primary's data."""
    infos = _read(fp, "_shared_param_infos", "FlatParameter")
    out = []
    for sp in infos:
        prim = (_read(sp, "prim_module_name", "SharedParamInfo"), _read(sp, "prim_param_name", "SharedParamInfo"))
        alias = (_read(sp, "module_name", "SharedParamInfo"), _read(sp, "param_name", "SharedParamInfo"))
        out.append((".".join(x for x in prim if x), ".".join(x for x in alias if x)))
    return tuple(out)


def orig_params(fp: nn.Parameter) -> tuple[nn.Parameter, ...] | None:
    """The original parameter variables (``fp._params``, use_orig_params=True; None otherwise),
    in ``orig_fqns`` order."""
    params = _read(fp, "_params", "FlatParameter")
    return None if params is None else tuple(params)


def shared_params(fp: nn.Parameter) -> tuple[nn.Parameter, ...]:
    """The tied parameters' variables (``fp._shared_params``; empty without use_orig_params)."""
    return tuple(_read(fp, "_shared_params", "FlatParameter") or ())


def is_flat_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is an FSDP1 FlatParameter (the ``_is_flat_param`` flag FSDP sets on them)."""
    return bool(getattr(p, "_is_flat_param", False))


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(raw fqn, tensor) of every persistent buffer, as ``state_dict`` would list them but
    without running state-dict hooks (FSDP1's all-gather)."""
    out = []
    for prefix, mod in model.named_modules():
        buffers = _read(mod, "_buffers", "nn.Module")
        skip = _read(mod, "_non_persistent_buffers_set", "nn.Module")
        for name, t in buffers.items():
            if t is not None and name not in skip:
                out.append((f"{prefix}.{name}" if prefix else name, t))
    return out


def dtensor_local_box(t: torch.Tensor) -> tuple[Shape, Shape]:
    """(offsets, lengths) of the box of DTensor ``t``'s global tensor this rank holds: what
    ``t.__create_chunk_list__()`` gives (one chunk per rank). For a DTensor whose local shard
    is a plain tensor and whose placements are shards and replicas, that method returns torch's
    ``compute_local_shape_and_global_offset`` of its shape, mesh and placements, after importing
    ``torch.distributed.checkpoint`` (0.1-0.2 s, in the first save or load of a fresh process):
    the function is called here directly; every other DTensor asks the method."""
    local = getattr(t, "_local_tensor", None)
    placements = getattr(t, "placements", None)
    if (
        _LOCAL_SHAPE_AND_OFFSET is not None
        and isinstance(local, torch.Tensor)
        and not hasattr(local, "__create_chunk_list__")
        and isinstance(placements, tuple)
        and all(p.is_shard() or p.is_replicate() for p in placements)
    ):
        sizes, offsets = _LOCAL_SHAPE_AND_OFFSET(t.shape, t.device_mesh, placements)  # type: ignore[attr-defined]
        return _ints(tuple(offsets), "DTensor", "local offsets"), _ints(tuple(sizes), "DTensor", "local shape")
    create = _read(t, "__create_chunk_list__", "DTensor")
    chunks = create()
    if len(chunks) != 1:
        raise FrameworkError(f"DTensor with {len(chunks)} local chunks is not supported")
    return (
        _ints(tuple(chunks[0].offsets), "ChunkStorageMetadata", "offsets"),
        _ints(tuple(chunks[0].sizes), "ChunkStorageMetadata", "sizes"),
    )


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of DTensor ``t`` (``t._local_tensor``; ``t.to_local()`` outside autograd
    when torch no longer has that attribute): the tensor whose memory this rank holds."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    with torch.no_grad():
        return t.to_local()  # type: ignore[no-any-return, attr-defined]  # a DTensor (callers check)
