"""``unickpt convert --from verl-fsdp SRC OUT``: a checkpoint of verl's own ``FSDPCheckpointManager``
(the folder with ``model_world_size_W_rank_R.pt``, ``optim_world_size_W_rank_R.pt``,
``extra_state_world_size_W_rank_R.pt`` and maybe ``fsdp_config.json``, e.g.
``global_step_N/actor``) into a unickpt checkpoint that loads at any world size, e.g. through
``unickpt.integrations.verl.UnickptFSDPCheckpointManager.load_checkpoint``.

Order of use: ``convert.from_verl_fsdp`` -> :func:`import_verl_fsdp`: :func:`find_rank_files`
(every rank 0..W-1 of one world size W, regular files only), each file read by
``ops.torch_save_read.read_torch_save`` (no code runs), then per tensor :func:`tensor_boxes`
(where each rank's piece lies in the whole tensor: a DTensor's placements on its mesh
coordinate, FSDP2; a ShardedTensor's shard offsets, FSDP1), :func:`assemble` (the pieces must
tile the tensor exactly, checked before it is allocated), and one ``unickpt.save`` of:

* ``model``: ``FlatTensors`` with ``model.<key>`` for every entry of verl's model state dict and
  ``optimizer.state.<param>.<name>`` for the optimizer's tensors, with the ``optimizer`` object
  (param groups by parameter name, non-tensor state) as unickpt's optimizer adapters save it;
* ``lr_scheduler``: rank 0's scheduler state (replicated, as the manager saves it);
* ``rng``: rank 0's generator states (``unickpt.PerRank``; the other ranks' are not written: one
  process writes the checkpoint; a load at any world size gives every rank rank 0's, under
  ``LoadOptions.restore.extra_state_on_resize``).

The optimizer: verl builds it over ``module.parameters()`` (one group), so its state's integer
ids are the model's parameters in order, i.e. the model state dict's distributed entries
(buffers are plain tensors), a tied parameter once. Every state tensor's shape is checked against
its parameter's; a mismatch is refused. FSDP1 (ShardedTensor) checkpoints: verl saves
``optimizer.state_dict()`` of flat parameters, whose layout needs the model's wrapping: the
optimizer is not converted (listed as skipped); model and extra state are.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigurationError, CorruptMetadataError, NotACheckpointError
from ..format.validation import box_coverage_problem
from .source_files import read_small_file
from .torch_save_read import Record, SubclassTensor, check_stored_tensor, read_torch_save

__all__ = ["import_verl_fsdp", "find_rank_files", "tensor_boxes", "assemble", "RankFiles"]

_FILE = re.compile(r"(model|optim|extra_state)_world_size_(\d{1,6})_rank_(\d{1,6})\.pt")
_CONFIG_LIMIT = 1 << 20
_DTENSOR = "torch.distributed.tensor.DTensor", "torch.distributed.tensor._api.DTensor"
_SHARDED = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


@dataclass(frozen=True, slots=True)
class RankFiles:
    """The rank files of one verl checkpoint: ``kind`` (model, optim, extra_state) -> names by rank."""

    world_size: int
    files: dict[str, list[str]]


def find_rank_files(folder: str) -> RankFiles:
    """Every rank's files, one world size, no rank missing (CheckpointError otherwise)."""
    if not os.path.isdir(folder):
        raise NotACheckpointError(f"{folder} is not a folder of a verl FSDP checkpoint")
    found: dict[str, dict[int, str]] = {}
    sizes = set()
    for name in sorted(os.listdir(folder)):
        m = _FILE.fullmatch(name)
        if m:
            kind, ws, rank = m.group(1), int(m.group(2)), int(m.group(3))
            sizes.add(ws)
            found.setdefault(kind, {})[rank] = name
    if "model" not in found:
        raise NotACheckpointError(f"{folder} holds no model_world_size_W_rank_R.pt: not a verl FSDP checkpoint")
    if len(sizes) != 1:
        raise CorruptMetadataError(f"{folder} holds verl files of several world sizes {sorted(sizes)}: convert one")
    ws = sizes.pop()
    files = {}
    for kind, ranks in found.items():
        if sorted(ranks) != list(range(ws)):
            missing = sorted(set(range(ws)) - set(ranks))
            raise CorruptMetadataError(
                f"{folder}: {kind}_world_size_{ws}_rank_R.pt is missing for ranks {missing} (or names ranks >= {ws})"
            )
        files[kind] = [ranks[r] for r in range(ws)]
    if os.path.lexists(os.path.join(folder, "fsdp_config.json")):
        raw = read_small_file(folder, "fsdp_config.json", _CONFIG_LIMIT, f"the verl checkpoint {folder}")
        try:
            config = json.loads(raw)
        except ValueError as e:
            raise CorruptMetadataError(f"{folder}/fsdp_config.json is not JSON: {e}") from None
        if not isinstance(config, dict) or config.get("world_size", ws) != ws:
            raise CorruptMetadataError(f"{folder}/fsdp_config.json says world size {config!r:.100}, the files {ws}")
    return RankFiles(ws, files)


# ----------------------------------------------------------------------------- pieces


@dataclass(frozen=True, slots=True)
class Box:
    """One rank's piece of a tensor: where it lies, its values, and whether it is the copy to
    use (a replica on a ``Replicate`` mesh dimension other than coordinate 0 is not)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor
    primary: bool = True


def _state(obj: Any, what: str) -> dict[str, Any]:
    state = obj.state if isinstance(obj, (Record, SubclassTensor)) else None
    if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
        state = state[1]
    if not isinstance(state, dict):
        raise CorruptMetadataError(f"{what} has no readable state")
    return state


def _kind(obj: Any) -> str:
    return type(obj).qualname if isinstance(obj, Record) else ""


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and 0 <= v < 1 << 62 for v in value):
        raise CorruptMetadataError(f"{what} is {value!r:.100}, not a list of non-negative integers")
    return tuple(value)


def _mesh_shape(mesh: Any, what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, this rank's coordinate) of a pickled DeviceMesh."""
    state = _state(mesh, f"{what}'s device mesh")
    coords = _ints(state.get("_coordinate_on_dim"), f"{what}'s mesh coordinate")
    layout = state.get("_layout")
    if isinstance(layout, Record):
        axes = _state(layout, f"{what}'s mesh layout").get("axes")
        if not isinstance(axes, tuple):
            raise CorruptMetadataError(f"{what}'s mesh layout has no axes")
        sizes = tuple(math.prod(_ints(_state(a, "a mesh axis").get("shape"), "a mesh axis")) for a in axes)
    elif isinstance(state.get("mesh"), torch.Tensor):  # DeviceMesh of older torch: the rank tensor
        sizes = tuple(state["mesh"].shape)
    else:
        raise CorruptMetadataError(f"{what}'s device mesh has neither a layout nor a rank tensor")
    if len(sizes) != len(coords) or any(c >= n for c, n in zip(coords, sizes)):
        raise CorruptMetadataError(f"{what}: mesh coordinate {coords} outside the mesh {sizes}")
    return sizes, coords


def tensor_boxes(value: SubclassTensor, what: str) -> list[Box]:
    """Where this rank's piece(s) of a DTensor / ShardedTensor lie in the whole tensor."""
    size = value.size
    if value.kind in _DTENSOR:
        state = _state(value, what)
        local, spec = state.get("_local_tensor"), state.get("_spec")
        if type(local) is not torch.Tensor or not _kind(spec).endswith("DTensorSpec"):
            raise CorruptMetadataError(f"{what} is a DTensor without a local tensor and spec")
        spec_state = _state(spec, what)
        mesh_sizes, coords = _mesh_shape(spec_state.get("mesh"), what)
        placements = spec_state.get("placements")
        if not isinstance(placements, tuple) or len(placements) != len(mesh_sizes):
            raise CorruptMetadataError(f"{what}: {placements!r:.100} are not one placement per mesh dimension")
        offsets, sizes, primary = [0] * len(size), list(size), True
        for placement, k, c in zip(placements, mesh_sizes, coords):
            kind = _kind(placement)
            if kind.endswith("placement_types.Replicate"):
                primary = primary and c == 0
            elif kind.endswith("placement_types.Shard"):
                dim = _state(placement, what).get("dim")
                if type(dim) is not int or not 0 <= dim < len(size):
                    raise CorruptMetadataError(f"{what}: Shard(dim={dim!r:.20}) of a {len(size)}-d tensor")
                length = sizes[dim]
                chunk = -(-length // k) if length else 0  # torch.chunk's rule, as DTensor shards
                start = min(c * chunk, length)
                offsets[dim] += start
                sizes[dim] = min(start + chunk, length) - start
            else:
                raise ConfigurationError(
                    f"{what} is placed {kind.rpartition('.')[2] or placement!r}: convert reads Shard and Replicate"
                )
        return [Box(tuple(offsets), tuple(sizes), local, primary)]
    if value.kind == _SHARDED:
        state = value.state
        if not (isinstance(state, tuple) and len(state) >= 2 and isinstance(state[0], list)):
            raise CorruptMetadataError(f"{what} is a ShardedTensor without local shards")
        boxes = []
        for shard in state[0]:
            st = _state(shard, what)
            tensor, md = st.get("tensor"), st.get("metadata")
            if type(tensor) is not torch.Tensor or not _kind(md).endswith("ShardMetadata"):
                raise CorruptMetadataError(f"{what} has a shard without a tensor and metadata")
            mds = _state(md, what)
            offs = _ints(mds.get("shard_offsets"), f"{what}'s shard offsets")
            lens = _ints(mds.get("shard_sizes"), f"{what}'s shard sizes")
            boxes.append(Box(offs, lens, tensor))
        return boxes
    raise ConfigurationError(f"{what} is a {value.kind}: convert reads DTensors and ShardedTensors")


def assemble(what: str, size: tuple[int, ...], dtype: torch.dtype, boxes: list[Box]) -> torch.Tensor:
    """The whole tensor from its pieces, which must tile it exactly, each holding every element
    of its storage at most once (``torch_save_read.check_stored_tensor``: no expanded local
    tensor), all checked before allocating: the whole holds no more bytes than the pieces' files."""
    used = [b for b in boxes if b.primary]
    for b in used:
        check_stored_tensor(b.tensor, f"{what}: a piece at offsets {b.offsets}")
        if len(b.offsets) != len(size) or len(b.sizes) != len(size):
            raise CorruptMetadataError(f"{what}: a piece of rank {len(b.offsets)} in a tensor of rank {len(size)}")
        if b.tensor.dtype != dtype or tuple(b.tensor.shape) != b.sizes:
            raise CorruptMetadataError(
                f"{what}: a piece holds a {b.tensor.dtype} tensor of shape {tuple(b.tensor.shape)}, "
                f"not the {dtype} of shape {b.sizes} its placement gives"
            )
    problem = box_coverage_problem(size, [(b.offsets, b.sizes) for b in used])
    if problem is not None:
        raise CorruptMetadataError(f"{what} (size {size}) is not tiled by the ranks' pieces: {problem}")
    out = torch.empty(size, dtype=dtype)
    for b in used:
        out[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))].copy_(b.tensor)
    return out


def _whole(key: str, per_rank: list[Any], where: str) -> tuple[torch.Tensor, bool]:
    """(the whole tensor, whether it was distributed) of one entry across the ranks."""
    first = per_rank[0]
    if type(first) is torch.Tensor:
        return first.clone(), False
    if not isinstance(first, SubclassTensor):
        raise CorruptMetadataError(f"{where}: {key!r} is a {type(first).__name__}, not a tensor")
    boxes = []
    for r, v in enumerate(per_rank):
        if not isinstance(v, SubclassTensor) or v.size != first.size or v.dtype != first.dtype or v.kind != first.kind:
            raise CorruptMetadataError(f"{where}: rank {r}'s {key!r} differs from rank 0's in kind, size or dtype")
        boxes.extend(tensor_boxes(v, f"{where}: rank {r}'s {key!r}"))
    return assemble(f"{where}: {key!r}", first.size, first.dtype, boxes), True


# ----------------------------------------------------------------------------- convert


class _Plain:
    """A value saved through ``state_dict()`` (the scheduler's state, rank 0's RNG)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, value: Any) -> None:
        self.value = value


def import_verl_fsdp(folder: str, out: str) -> tuple[int, tuple[str, ...], str]:
    """Convert the verl FSDP checkpoint in ``folder`` into a unickpt checkpoint in ``out``
    (module docstring); ``convert.from_verl_fsdp`` calls it. Returns (tensors written, what was
    skipped, the layout recognised)."""
    import unickpt

    from ..format.values import encode_value
    from ..frameworks.flat import FlatTensors
    from ..state.items import PerRank

    if os.path.exists(out) and os.listdir(out):
        raise ConfigurationError(f"convert: {out} is not empty; convert writes a new checkpoint only")
    rf = find_rank_files(folder)
    skipped: list[str] = []
    models = [_mapping(read_torch_save(folder, n, f"the verl checkpoint {folder}"), n) for n in rf.files["model"]]
    for name, m in zip(rf.files["model"], models):
        _names_only(m, os.path.join(folder, name), "model state dict")
    keys = list(models[0])
    for r, m in enumerate(models):
        if list(m) != keys:
            raise CorruptMetadataError(f"{folder}: rank {r}'s model state dict names other entries than rank 0's")
    tensors: dict[str, torch.Tensor] = {}
    params: list[str] = []  # distributed entries in order, a tied one once: the optimizer's ids
    seen: dict[int, str] = {}
    for key in keys:
        whole, distributed = _whole(key, [m[key] for m in models], rf.files["model"][0])
        tensors[f"model.{key}"] = whole
        if distributed and id(models[0][key]) not in seen:
            seen[id(models[0][key])] = key
            params.append(key)
    fsdp1 = any(isinstance(v, SubclassTensor) and v.kind == _SHARDED for v in models[0].values())
    objects: dict[str, Any] = {}
    if "optim" in rf.files and fsdp1:
        skipped.append(
            "optim_world_size_*.pt (FSDP1: the state of flat parameters, whose layout needs the model's wrapping)"
        )
    elif "optim" in rf.files:
        optims = [_mapping(read_torch_save(folder, n, f"the verl checkpoint {folder}"), n) for n in rf.files["optim"]]
        optim_tensors, objects["optimizer"] = _optimizer(optims, params, tensors, rf.files["optim"][0])
        tensors.update(optim_tensors)
    state: dict[str, Any] = {"model": FlatTensors(tensors, {k: encode_value(v, k) for k, v in objects.items()})}
    if "extra_state" in rf.files:
        extra = _mapping(read_torch_save(folder, rf.files["extra_state"][0], f"the verl checkpoint {folder}"), "extra")
        if extra.get("lr_scheduler") is not None:
            state["lr_scheduler"] = _Plain(extra["lr_scheduler"])
        if extra.get("rng") is not None:
            state["rng"] = PerRank(_Plain(extra["rng"]))
        if rf.world_size > 1:
            skipped.append(f"extra_state of ranks 1..{rf.world_size - 1} (their RNG states: rank 0's is converted)")
    unickpt.save(out, state, framework="tensors")
    return len(tensors), tuple(skipped), f"verl FSDP{1 if fsdp1 else 2}, world size {rf.world_size}"


def _names_only(state: dict[Any, Any], path: str, what: str) -> None:
    """``CorruptMetadataError`` unless every key of ``state`` is a string: keys become tensor
    names (``model.<key>``), so ``1`` and ``"1"`` (or a tuple) would collide or be renamed."""
    for key in state:
        if type(key) is not str:
            raise CorruptMetadataError(
                f"{path}: the {what} names an entry by the {type(key).__name__} {key!r:.60}, not a string "
                "(entry names become tensor names: refused rather than let two entries collide)"
            )


def _mapping(value: Any, name: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise CorruptMetadataError(f"{name} holds a {type(value).__name__}, not a state dict")
    return value


def _optimizer(
    optims: list[dict[Any, Any]], params: list[str], model: dict[str, torch.Tensor], where: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer tensors ``optimizer.state.<param>.<name>`` and the ``optimizer`` object."""
    groups = optims[0].get("param_groups")
    states: list[dict[Any, Any]] = []
    for o in optims:
        st = o.get("state")
        if not isinstance(st, dict):
            raise CorruptMetadataError(f"{where} is not an optimizer state dict (state, param_groups)")
        states.append(st)
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CorruptMetadataError(f"{where} is not an optimizer state dict (state, param_groups)")
    ids = [i for g in groups for i in g["params"]]
    for st in states:
        stray = [k for k in st if type(k) is not int or not 0 <= k < len(params)]
        if stray:
            raise CorruptMetadataError(
                f"{where}: the optimizer state names {stray[0]!r:.60}, not a parameter index 0..{len(params) - 1}"
            )
    if sorted(ids) != list(range(len(params))):
        raise ConfigurationError(
            f"{where}: the optimizer updates {len(ids)} parameters, the model has {len(params)} distributed "
            "ones: cannot tell which state is whose (verl builds the optimizer over module.parameters())"
        )
    out: dict[str, torch.Tensor] = {}
    values: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(params):
        per_rank = [s.get(i, {}) for s in states]
        for key in per_rank[0]:
            if type(key) is not str:
                raise CorruptMetadataError(f"{where}: parameter {i}'s state is named by a {type(key).__name__}")
            value = per_rank[0][key]
            if isinstance(value, (torch.Tensor, SubclassTensor)):
                whole, distributed = _whole(f"state[{i}][{key!r}]", [s.get(key) for s in per_rank], where)
                if distributed and whole.shape != model[f"model.{name}"].shape:
                    raise ConfigurationError(
                        f"{where}: state {key!r} of parameter {i} has the shape {tuple(whole.shape)}, the "
                        f"{i}-th parameter of the model ({name}) {tuple(model[f'model.{name}'].shape)}"
                    )
                if f"optimizer.state.{name}.{key}" in out:
                    raise CorruptMetadataError(
                        f"{where}: state {key!r} of parameter {i} ({name}) has the name of another parameter's "
                        f"state (optimizer.state.{name}.{key}): refused rather than keep one of them"
                    )
                out[f"optimizer.state.{name}.{key}"] = whole
            else:
                values.setdefault(name, {})[key] = value
    entries = []
    for g in groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = [params[i] for i in g["params"]]
        entries.append(entry)
    return out, {"param_groups": entries, "state_values": values}
