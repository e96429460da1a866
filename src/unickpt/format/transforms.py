"""Tensors derived from a checkpoint's tensors as it is read (``LoadOptions(restore=RestoreOptions(transforms=...))``):
a fused QKV projection split into Q, K and V, Megatron's per-group interleaved QKV de-interleaved,
separate Q/K/V fused into one, any tensor cut or joined along its first dimension.

A ``RowsTensor`` is the concatenation, along dimension 0, of row ranges (``Rows``) of saved
tensors (which must agree in dtype and in every other dimension). ``derive(md, transforms)``
(pure; called by the load pipeline after ``key_map``, before validation) adds each derived
tensor's record and drops the sources it consumed, so the rest of the load (validation against
the live state, read planning, zero-redundancy reads, verification) treats it as saved.

Why no byte is copied or read twice in the common case: the rows of a saved box are contiguous in
its row-major bytes, so a row sub-range of any shard (FSDP row splits, TP column splits alike) is
one contiguous byte range of the same file. A shard lying inside one range becomes a shard of the
derived tensor with its bytes unchanged; a shard straddling a range boundary becomes a shard of
the part of its bytes in the range. Verification needs nothing special: the reader reads the
checksum units covering whatever byte range it needs (``format.checksums``: the file chunks of
format version 3, the whole saved shard of versions 1 and 2) and verifies each.

Errors (``PlanningError``): an unknown source, row ranges outside it, parts whose dtype or other
dimensions differ, two transforms of one key, a derived key that exists already (and is not a
consumed source). A source may feed several derived tensors (Q, K and V of one fused tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import PlanningError
from .dtypes import itemsize
from .records import Metadata, ShardRecord, TensorRecord

__all__ = ["Rows", "RowsTensor", "derive", "split_rows", "fuse_rows", "megatron_qkv_split", "megatron_qkv_fuse"]


@dataclass(frozen=True, slots=True)
class Rows:
    """Rows ``[start, stop)`` (dimension 0) of the saved tensor ``source`` (a checkpoint key)."""

    source: str
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class RowsTensor:
    """The tensor ``key``: its ``parts`` concatenated along dimension 0, in order."""

    key: str
    parts: tuple[Rows, ...]


def split_rows(source: str, targets: Sequence[tuple[str, int]]) -> list[RowsTensor]:
    """``source`` cut along dimension 0 into ``targets`` (key, number of rows), in order:
    ``split_rows("model.qkv.weight", [("model.q.weight", 64), ("model.k.weight", 16), ...])``."""
    out, at = [], 0
    for key, n in targets:
        out.append(RowsTensor(key, (Rows(source, at, at + n),)))
        at += n
    return out


def fuse_rows(key: str, sources: Sequence[tuple[str, int]]) -> RowsTensor:
    """``sources`` (key, number of rows) concatenated along dimension 0 into ``key``."""
    return RowsTensor(key, tuple(Rows(s, 0, n) for s, n in sources))


def megatron_qkv_split(
    source: str, q: str, k: str, v: str, *, num_query_groups: int, heads_per_group: int, head_dim: int
) -> list[RowsTensor]:
    """Megatron's fused ``linear_qkv`` (per query group: ``heads_per_group`` query heads, then
    one key head, then one value head, each ``head_dim`` rows) de-interleaved into separate Q, K
    and V tensors (HF layout: heads in order). Works for weights and biases (dimension 0)."""
    group = (heads_per_group + 2) * head_dim
    qs, ks, vs = [], [], []
    for g in range(num_query_groups):
        base = g * group
        qs.append(Rows(source, base, base + heads_per_group * head_dim))
        ks.append(Rows(source, base + heads_per_group * head_dim, base + (heads_per_group + 1) * head_dim))
        vs.append(Rows(source, base + (heads_per_group + 1) * head_dim, base + group))
    return [RowsTensor(q, tuple(qs)), RowsTensor(k, tuple(ks)), RowsTensor(v, tuple(vs))]


def megatron_qkv_fuse(
    key: str, q: str, k: str, v: str, *, num_query_groups: int, heads_per_group: int, head_dim: int
) -> RowsTensor:
    """The inverse of ``megatron_qkv_split``: separate Q, K, V interleaved per query group."""
    parts = []
    qn = heads_per_group * head_dim
    for g in range(num_query_groups):
        parts += [Rows(q, g * qn, (g + 1) * qn), Rows(k, g * head_dim, (g + 1) * head_dim)]
        parts.append(Rows(v, g * head_dim, (g + 1) * head_dim))
    return RowsTensor(key, tuple(parts))


def _derived_shards(rec: TensorRecord, part: Rows, at: int, row_bytes: int) -> list[ShardRecord]:
    """The shards of ``rec`` (a source) that hold rows of ``part``, placed at row ``at`` of the
    derived tensor: whole shards unchanged, straddling ones cut to the part of their bytes in it."""
    out = []
    for s in rec.shards:
        lo, hi = s.offsets[0], s.offsets[0] + s.lengths[0]
        a, b = max(lo, part.start), min(hi, part.stop)
        if a >= b:
            continue
        box_row_bytes = row_bytes
        for n in s.lengths[1:]:
            box_row_bytes *= n
        offsets = (at + a - part.start, *s.offsets[1:])
        lengths = (b - a, *s.lengths[1:])
        if (a, b) == (lo, hi):
            out.append(replace(s, offsets=offsets, lengths=lengths))
            continue
        out.append(
            ShardRecord(
                offsets,
                lengths,
                s.file_index,
                s.byte_offset + (a - lo) * box_row_bytes,
                (b - a) * box_row_bytes,
            )
        )
    return out


_MODEL, _STATE = "model.", "optimizer.state."


def _state_names(md: Metadata, fqn: str) -> dict[str, str]:
    """Optimizer state saved for parameter ``fqn``: state name -> checkpoint key."""
    head = f"{_STATE}{fqn}."
    return {k[len(head) :]: k for k in md.tensors if k.startswith(head) and "." not in k[len(head) :]}


def _with_optimizer(md: Metadata, transforms: Sequence[RowsTensor]) -> tuple[list[RowsTensor], dict[str, str]]:
    """``transforms`` plus, for each one deriving a parameter from parameters (``model.*``), the
    same rows of every optimizer state tensor saved for all its sources (``exp_avg`` ...); and
    the scalar states (``step``) the derived parameter takes from its first source:
    derived key -> source key."""
    out, scalars = list(transforms), {}
    for t in transforms:
        if not t.key.startswith(_MODEL) or not all(p.source.startswith(_MODEL) for p in t.parts):
            continue
        fqn = t.key[len(_MODEL) :]
        names = [_state_names(md, p.source[len(_MODEL) :]) for p in t.parts]
        for name, first_key in names[0].items():
            if not all(name in n for n in names):
                continue
            rec = md.tensors[first_key]
            target = f"{_STATE}{fqn}.{name}"
            if not rec.shape:
                scalars[target] = first_key
                continue
            parts = tuple(Rows(n[name], p.start, p.stop) for n, p in zip(names, t.parts))
            out.append(RowsTensor(target, parts))
    return out, scalars


def _derive_optimizer_object(obj: Any, transforms: Sequence[RowsTensor]) -> Any:
    """Param groups and non-tensor state values follow the derived parameters: a source's name in
    a group is replaced by the parameters derived from it; a derived parameter takes the values
    of its first source."""
    if not isinstance(obj, dict):
        return obj
    derived_from: dict[str, list[str]] = {}
    first_source: dict[str, str] = {}
    for t in transforms:
        if t.key.startswith(_MODEL) and all(p.source.startswith(_MODEL) for p in t.parts):
            key = t.key[len(_MODEL) :]
            first_source[key] = t.parts[0].source[len(_MODEL) :]
            for p in t.parts:
                derived = derived_from.setdefault(p.source[len(_MODEL) :], [])
                if key not in derived:
                    derived.append(key)
    if not derived_from:
        return obj
    out = dict(obj)
    groups = []
    for group in obj.get("param_groups", []):
        if isinstance(group, dict) and isinstance(group.get("params"), list):
            names: list[str] = []
            for name in group["params"]:
                for new in derived_from.get(name, [name]) if isinstance(name, str) else [name]:
                    if new not in names:
                        names.append(new)
            groups.append({**group, "params": names})
        else:
            groups.append(group)
    if "param_groups" in obj:
        out["param_groups"] = groups
    values = obj.get("state_values")
    if isinstance(values, dict):
        mapped = {k: v for k, v in values.items() if k not in derived_from}
        for key, src in first_source.items():
            if src in values:
                mapped[key] = values[src]
        out["state_values"] = mapped
    return out


def derive(md: Metadata, transforms: Sequence[RowsTensor] | None) -> Metadata:
    """``md`` with the derived tensors added and their sources removed (module docstring);
    ``md`` itself when there is nothing to derive. A transform of parameters (``model.*`` keys)
    carries their optimizer state and param-group membership along."""
    if not transforms:
        return md
    user_transforms = list(transforms)
    for t in user_transforms:
        if not isinstance(t, RowsTensor) or not t.parts:
            raise PlanningError(f"a transform must be a RowsTensor with at least one part, got {t!r}")
    transforms, scalars = _with_optimizer(md, user_transforms)
    tensors = dict(md.tensors)
    keys = [t.key for t in transforms]
    if len(set(keys)) != len(keys):
        raise PlanningError(f"two transforms derive {next(k for k in keys if keys.count(k) > 1)!r}")
    sources = {p.source for t in transforms for p in t.parts}
    derived: dict[str, TensorRecord] = {}
    for t in transforms:
        first = md.tensors.get(t.parts[0].source)
        if first is None:
            raise PlanningError(f"transform {t.key!r}: the checkpoint has no tensor {t.parts[0].source!r}")
        if not first.shape:
            raise PlanningError(f"transform {t.key!r}: {t.parts[0].source!r} is a scalar (no rows to take)")
        rest, dtype = tuple(first.shape[1:]), first.dtype
        row_bytes = itemsize(dtype)
        shards: list[ShardRecord] = []
        at = 0
        for p in t.parts:
            rec = md.tensors.get(p.source)
            if rec is None:
                raise PlanningError(f"transform {t.key!r}: the checkpoint has no tensor {p.source!r}")
            if rec.dtype != dtype or tuple(rec.shape[1:]) != rest or not rec.shape:
                raise PlanningError(
                    f"transform {t.key!r}: {p.source!r} is {rec.dtype} {list(rec.shape)}, unlike "
                    f"{t.parts[0].source!r} ({dtype} {list(first.shape)}): parts must agree in dtype "
                    "and in every dimension but the first"
                )
            if not (isinstance(p.start, int) and isinstance(p.stop, int) and 0 <= p.start < p.stop <= rec.shape[0]):
                raise PlanningError(
                    f"transform {t.key!r}: rows [{p.start}, {p.stop}) are not inside {p.source!r} ({rec.shape[0]} rows)"
                )
            shards += _derived_shards(rec, p, at, row_bytes)
            at += p.stop - p.start
        derived[t.key] = TensorRecord(t.key, dtype, (at, *rest), tuple(shards))
    for key in derived:
        if key in tensors and key not in sources:
            raise PlanningError(f"transform {key!r}: the checkpoint has a tensor of that name already")
    for target, source in scalars.items():
        derived[target] = replace(md.tensors[source], fqn=target)
        sources.add(source)
    for s in sources:
        tensors.pop(s, None)
    tensors.update(derived)
    objects = dict(md.objects)
    if "optimizer" in objects:
        objects["optimizer"] = _derive_optimizer_object(objects["optimizer"], user_transforms)
    return replace(md, tensors=tensors, objects=objects)
