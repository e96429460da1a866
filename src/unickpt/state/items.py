"""The kinds of value a ``state`` dict holds, one class each: how a value of that kind is described
for planning, saved, validated and applied. ``state.layout`` picks the kind of every key; the
pipelines call these methods and decide nothing about a kind themselves.

A kind is added here (a ``StateItem`` subclass) and in ``layout.item_for``; nothing else changes.

=============  ============================================================================
kind           described / saved / validated / applied
=============  ============================================================================
module         an ``nn.Module`` or a list of them (model parts): described by the framework
               adapter (``layout.StateLayout.framework_state``; checkpoint keys ``model.<fqn>``
               or ``<key>.<fqn>``), loaded in place by the adapter's view
optimizer      an optimizer, a list of them, a wrapper (``frameworks.parts``): described and
               loaded by the adapter, state keyed by the parameter names of the state's modules
stateful       an object with ``state_dict()`` / ``load_state_dict()`` (LR scheduler,
               ``GradScaler``, a user's train state): its ``state_dict()`` saved once, by rank
               0, as blob ``<key>/replicated``, its tensors (DTensors too) as checkpoint
               tensors ``<key>.<path>`` that reshard; every rank must have the same (checked
               at save by a digest in the describe collective); loaded on every rank
stateful_list  a list (or tuple) of Statefuls (``"lr_scheduler": [sched0, sched1]``): one stateful
               item whose ``state_dict()`` is the list of theirs (``StatefulList``), tensors
               ``<key>.<i>.<path>``; its length recorded and checked before anything is read
per_rank       ``unickpt.PerRank(obj)``: a stateful object whose state differs per rank: blob
               ``<key>/rank<r>`` per rank; after a change of world size
               ``LoadOptions.restore.extra_state_on_resize`` decides (as for extra state)
value          anything else (plain values, tensors, numpy values; ``extra_state``): blob
               ``<key>/rank<r>`` per rank, restored into the dict (``state[key] = value``);
               None at load is a placeholder to be filled
dataloader     ``state["dataloader"]``: the ``unickpt.data`` protocol or a per-rank
               ``state_dict`` loader (``state.loader``)
=============  ============================================================================

Order of use, per item, on every rank:
  save  ``encode(rank)`` in the describe stage: blobs (safe value encoding; an unsupported value
        raises ``UnsupportedValueError`` naming its path), claims (values every rank must
        share) and tensor shards; ``kind`` goes into the metadata objects (``layout``).
  load  ``destinations(md)`` and ``choose(ctx)`` in the validate stage: which blobs this rank reads, which keys are
        missing (raising for what cannot be restored) -> the blobs are read -> ``apply(state,
        values)`` in the apply stage, after the adapter's view applied the tensors.
"""

from __future__ import annotations

import enum
import hashlib
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from ..errors import (
    CheckpointError,
    ExtraStateResizeError,
    FrameworkError,
    LoaderStateError,
    StatefulListMismatchError,
    UnsupportedValueError,
)
from ..format.dtypes import dtype_from_name
from ..format.records import Metadata
from ..format.values import dumps_value
from ..frameworks.module_state import tensor_piece
from ..planning.objects import STATE_KEYS_OBJECT
from ..planning.specs import LoadItem, SaveItem
from .extra import extra_blob_key, pick_extra_blob
from .loader import LEGACY_PREFIX, LOADER_SECTION, LoaderIndex, is_reshardable, loader_blobs
from .resize_notice import MAX_PEER_BYTES, peer_values, peer_what, shared_state_notice
from .tree import escapes_dicts, join_tensors, list_lengths, split_tensors

__all__ = [
    "Kind",
    "PerRank",
    "LoadContext",
    "Encoded",
    "StateItem",
    "ModuleItem",
    "OptimizerItem",
    "StatefulItem",
    "StatefulListItem",
    "StatefulList",
    "PerRankItem",
    "ValueItem",
    "LoaderItem",
    "encode_value",
]


class Kind(enum.Enum):
    MODULE = "module"
    OPTIMIZER = "optimizer"
    STATEFUL = "stateful"
    STATEFUL_LIST = "stateful_list"
    PER_RANK = "per_rank"
    VALUE = "value"
    DATALOADER = "dataloader"


@dataclass(frozen=True, slots=True)
class PerRank:
    """Marks a stateful object whose state is per rank (saved by every rank, restored by rank
    under ``LoadOptions.restore.extra_state_on_resize`` after a change of world size):
    ``state["rng_gen"] = unickpt.PerRank(my_generator_state)``."""

    obj: Any

    def __post_init__(self) -> None:
        if not _is_stateful(self.obj):
            raise FrameworkError(
                "unickpt.PerRank needs an object with state_dict() and load_state_dict(), "
                f"got {type(self.obj).__name__}"
            )


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


@dataclass(frozen=True, slots=True)
class LoadContext:
    """What ``choose`` needs of a load: the metadata, this rank and the world, the resize policies."""

    md: Metadata
    rank: int
    world_size: int
    extra_on_resize: str = "modulo"
    loader_on_resize: str = "error"
    blob_keys: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True, slots=True)
class Encoded:
    """What an item saves on one rank: blobs (key -> encoded bytes) and claims (what every rank
    must pass alike -> a digest)."""

    blobs: dict[str, bytes] = field(default_factory=dict)
    claims: dict[str, str] = field(default_factory=dict)
    tensors: list[SaveItem] = field(default_factory=list)  # shards of tensors saved as tensors


def encode_value(value: Any, where: str) -> bytes:
    """``dumps_value``, its refusals as ``UnsupportedValueError`` naming ``where``."""
    try:
        return dumps_value(value, where)
    except CheckpointError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise UnsupportedValueError(f"cannot save {where}: {e}") from e


def _state_dict(key: str, obj: Any, where: str = "") -> Any:
    """``obj.state_dict()`` of ``state[key]`` (``where``: its place inside, e.g. ``[1]``)."""
    try:
        return obj.state_dict()
    except CheckpointError:
        raise
    except Exception as e:
        raise FrameworkError(f"state[{key!r}]{where}.state_dict() failed: {e!r}") from e


@dataclass(frozen=True, eq=False)
class StateItem:
    """One key of ``state`` (see the module docstring for the order of calls)."""

    key: str
    value: Any
    kind: ClassVar[Kind]
    by_adapter: ClassVar[bool] = False  # described and loaded by the framework adapter

    def encode(self, rank: int) -> Encoded:
        return Encoded()

    def choose(self, ctx: LoadContext) -> tuple[dict[str, str], list[str]]:
        """(what -> blob key to read, missing keys); raises for what cannot be restored."""
        return {}, []

    def destinations(self, md: Metadata) -> tuple[list[LoadItem], dict[str, torch.Tensor]]:
        """Tensors this item loads through the tensor path: (destinations for the engine, checkpoint
        key -> the tensor ``apply`` receives); nothing changes in the job."""
        return [], {}

    def apply(self, state: MutableMapping[str, Any], values: Mapping[str, Any]) -> None:
        """Make the read ``values`` (what -> decoded value) the live state."""


@dataclass(frozen=True, eq=False)
class ModuleItem(StateItem):
    kind: ClassVar[Kind] = Kind.MODULE
    by_adapter: ClassVar[bool] = True


@dataclass(frozen=True, eq=False)
class OptimizerItem(StateItem):
    """``optimizers``: what ``value`` stands for (``frameworks.parts.unwrap_optimizer``)."""

    optimizers: tuple[Any, ...] = ()
    kind: ClassVar[Kind] = Kind.OPTIMIZER
    by_adapter: ClassVar[bool] = True


def _per_rank_choice(key: str, ctx: LoadContext) -> tuple[dict[str, str], list[str]]:
    """The per-rank blob of ``key`` this rank restores (``LoadOptions.restore.extra_state_on_resize``)."""
    saved = ctx.md.topology.world_size
    if saved == ctx.world_size:
        blob = pick_extra_blob(set(ctx.blob_keys), ctx.rank, saved, key)
    elif ctx.extra_on_resize == "error":
        raise ExtraStateResizeError(
            f"the checkpoint's {key} was saved per rank by {saved} ranks and this job has {ctx.world_size}; "
            "choose LoadOptions(restore=RestoreOptions(extra_state_on_resize='modulo' | 'rank0' | 'skip'))"
        )
    elif ctx.extra_on_resize == "skip":
        if ctx.rank == 0:
            warnings.warn(
                f"{key} not restored: saved by {saved} ranks, loading on {ctx.world_size} "
                "(LoadOptions(restore=RestoreOptions(extra_state_on_resize='skip')))",
                stacklevel=6,
            )
        return {}, []
    else:
        blob = pick_extra_blob(set(ctx.blob_keys), 0 if ctx.extra_on_resize == "rank0" else ctx.rank, saved, key)
        if blob is not None and ctx.rank == 0 and ctx.extra_on_resize == "modulo" and ctx.world_size > saved:
            return {"value": blob, **_peer_blobs(key, ctx)}, []  # compared in apply (resize_notice)
    return ({"value": blob}, []) if blob is not None else ({}, [key])


def _peer_blobs(key: str, ctx: LoadContext) -> dict[str, str]:
    """Every saved rank's blob of ``key``, for rank 0 to tell whether ranks now share values;
    none (and the warning now) when they are too large to compare."""
    peers = {r: extra_blob_key(r, key) for r in range(ctx.md.topology.world_size)}
    peers = {r: b for r, b in peers.items() if b in ctx.md.blobs}
    if sum(ctx.md.blobs[b].byte_length for b in peers.values()) > MAX_PEER_BYTES:
        notice = shared_state_notice(key, [], ctx.md.topology.world_size, unread=True)
        warnings.warn(str(notice), stacklevel=7)
        return {}
    return {peer_what(r): b for r, b in peers.items()}


def _warn_if_shared(key: str, values: Mapping[str, Any]) -> None:
    """On rank 0 after growing: warn when the saved ranks' values of ``key`` differ (``resize_notice``)."""
    saved = peer_values(values)
    notice = shared_state_notice(key, saved, len(saved)) if saved else None
    if notice is not None:
        warnings.warn(notice, stacklevel=7)


def _has_per_rank(key: str, ctx: LoadContext) -> bool:
    return extra_blob_key(0, key) in ctx.blob_keys


def replicated_blob_key(key: str) -> str:
    return f"{key}/replicated"


@dataclass(frozen=True, eq=False)
class ValueItem(StateItem):
    kind: ClassVar[Kind] = Kind.VALUE

    def encode(self, rank: int) -> Encoded:
        if self.value is None:
            return Encoded()
        return Encoded({extra_blob_key(rank, self.key): encode_value(self.value, self.key)})

    def choose(self, ctx: LoadContext) -> tuple[dict[str, str], list[str]]:
        return _per_rank_choice(self.key, ctx)

    def apply(self, state: MutableMapping[str, Any], values: Mapping[str, Any]) -> None:
        _warn_if_shared(self.key, values)
        if "value" in values:
            state[self.key] = values["value"]


@dataclass(frozen=True, eq=False)
class StatefulItem(StateItem):
    """Replicated: saved once (rank 0), the same on every rank (claimed by digest). Its tensors
    (DTensors and plain tensors, at any depth of dicts, lists and tuples) are saved as checkpoint
    tensors ``<key>.<path>``, so they reshard like model tensors; the blob holds a placeholder
    for each."""

    kind: ClassVar[Kind] = Kind.STATEFUL

    @property
    def obj(self) -> Any:
        """The object with ``state_dict()`` / ``load_state_dict()``."""
        return self.value

    @property
    def length(self) -> int | None:
        """None: one object (``StatefulListItem``: the length of its list)."""
        return None

    def encode(self, rank: int) -> Encoded:
        plain, tensors = split_tensors(self.key, _state_dict(self.key, self.obj))
        data = encode_value(plain, f"state[{self.key!r}].state_dict()")
        digest = hashlib.blake2b(data, digest_size=12)
        items = []
        with torch.no_grad():
            for ckey, live in tensors.items():
                t = live
                if not isinstance(t, DTensor):  # replicated: the same bytes on every rank
                    t = t.detach().resolve_conj().resolve_neg()  # a conjugate / negative view: its values
                    digest.update(_raw(t.cpu()))
                piece = tensor_piece(ckey, t)
                items.append(SaveItem(piece.spec, piece.tensor))
        blobs = {replicated_blob_key(self.key): data} if rank == 0 else {}
        return Encoded(blobs, {claim_name(self.key): digest.hexdigest()}, items)

    def destinations(self, md: Metadata) -> tuple[list[LoadItem], dict[str, torch.Tensor]]:
        prefix = f"{self.key}."
        saved = {k: r for k, r in md.tensors.items() if k.startswith(prefix)}
        if not saved:
            return [], {}
        _, live = split_tensors(self.key, _state_dict(self.key, self.obj))
        items: list[LoadItem] = []
        fresh: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for ckey, rec in saved.items():
                like, dtype, shape = live.get(ckey), dtype_from_name(rec.dtype), tuple(rec.shape)
                if like is not None and _in_place(like, shape, dtype):  # read into the live tensor itself
                    piece = tensor_piece(ckey, like)
                    items.append(LoadItem(piece.spec, piece.tensor))
                    fresh[ckey] = like
                    continue
                if like is not None and tuple(like.shape) == shape:
                    t = torch.empty_like(like, dtype=dtype)
                else:  # no live tensor of that shape: a whole one, as saved
                    t = torch.empty(shape, dtype=dtype)
                piece = tensor_piece(ckey, t)
                items.append(LoadItem(piece.spec, piece.tensor, True))
                fresh[ckey] = t if like is None else _typed_like(t, like)
        return items, fresh

    def choose(self, ctx: LoadContext) -> tuple[dict[str, str], list[str]]:
        _check_saved_list(ctx.md, self.key, self.length)
        blob = replicated_blob_key(self.key)
        if blob in ctx.blob_keys:
            return {_replicated_what(ctx.md): blob}, []
        if _has_per_rank(self.key, ctx):  # saved as unickpt.PerRank
            return _per_rank_choice(self.key, ctx)
        return {}, [self.key]

    def apply(self, state: MutableMapping[str, Any], values: Mapping[str, Any]) -> None:
        _warn_if_shared(self.key, values)  # a PerRank's, after growing
        if "value" in values:  # a per-rank blob: the state_dict() as it was, tensors inside
            self.obj.load_state_dict(values["value"])
        for what in (_SPLIT, _SPLIT_ESCAPED):
            if what in values:  # the replicated blob: placeholders for the tensors loaded apart
                tensors = {k[len(TENSOR_VALUE) :]: v for k, v in values.items() if k.startswith(TENSOR_VALUE)}
                self.obj.load_state_dict(join_tensors(values[what], tensors, self.key, what == _SPLIT_ESCAPED))


@dataclass(frozen=True, eq=False)
class StatefulListItem(StatefulItem):
    """A list (or tuple) of Statefuls under one key (``"lr_scheduler": [sched0, sched1]``): one
    replicated item whose ``state_dict()`` is the list of theirs (``StatefulList``), saved and
    resharded as a single one (tensors ``<key>.<i>.<path>``). Its length is recorded (metadata
    object ``state_encoding``, ``lists``) and checked before anything is read."""

    kind: ClassVar[Kind] = Kind.STATEFUL_LIST

    @property
    def obj(self) -> StatefulList:
        return StatefulList(self.key, tuple(self.value))

    @property
    def length(self) -> int | None:
        return len(self.value)


@dataclass(frozen=True, eq=False)
class StatefulList:
    """The Statefuls of one key seen as one: ``state_dict()`` is the list of theirs,
    ``load_state_dict(list)`` gives each its own (``StatefulListMismatchError`` for another length)."""

    key: str
    objs: tuple[Any, ...]

    def state_dict(self) -> list[Any]:
        return [_state_dict(self.key, o, f"[{i}]") for i, o in enumerate(self.objs)]

    def load_state_dict(self, value: Any) -> None:
        if type(value) is not list or len(value) != len(self.objs):
            got = f"a list of {len(value)}" if type(value) is list else f"a {type(value).__name__}"
            raise StatefulListMismatchError(
                f"state[{self.key!r}] is a list of {len(self.objs)} Stateful objects and the checkpoint holds {got} "
                "there: give as many as were saved"
            )
        for o, v in zip(self.objs, value):
            o.load_state_dict(v)


def _check_saved_list(md: Metadata, key: str, live: int | None) -> None:
    """``StatefulListMismatchError`` unless the checkpoint saved under ``key`` what the live state
    has there: one Stateful (``live`` None) or a list of ``live`` (checkpoints that do not record
    their keys or list lengths: checked when the blob is applied)."""
    kinds = md.objects.get(STATE_KEYS_OBJECT)
    saved = kinds.get(key) if isinstance(kinds, dict) else None
    length = list_lengths(md.objects).get(key)
    if saved == Kind.STATEFUL_LIST.value and live is None:
        raise StatefulListMismatchError(
            f"the checkpoint holds a list of {length} Stateful objects under state[{key!r}] and this job one: "
            "give a list of as many (or leave the key out with strict=False)"
        )
    if saved == Kind.STATEFUL_LIST.value and length is not None and length != live:
        raise StatefulListMismatchError(
            f"the checkpoint holds a list of {length} Stateful objects under state[{key!r}] and this job a list "
            f"of {live}: give as many as were saved (or leave the key out with strict=False)"
        )
    if saved in (Kind.STATEFUL.value, Kind.PER_RANK.value) and live is not None:
        raise StatefulListMismatchError(
            f"the checkpoint holds one Stateful object under state[{key!r}] and this job a list of {live}: "
            "give one object there (or leave the key out with strict=False)"
        )


def _raw(t: torch.Tensor) -> bytes:
    """The row-major bytes of a CPU tensor (contiguous: a size-1 dimension may still have any
    stride, e.g. ``z.imag`` of one element, which ``view(torch.uint8)`` refuses)."""
    t = t.contiguous()
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _in_place(like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether the saved tensor loads into the live one itself (its identity kept: a parameter an
    optimizer holds stays that parameter): same shape and dtype, dense, its local data contiguous
    and not a conjugate / negative view."""
    if tuple(like.shape) != shape or like.dtype != dtype or like.layout != torch.strided or like.is_meta:
        return False
    loc = like.to_local() if isinstance(like, DTensor) else like
    return loc.is_contiguous() and not loc.is_conj() and not loc.is_neg()


def _typed_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (a fresh tensor loaded in ``like``'s place) as a ``Parameter`` when ``like`` is one,
    requiring grad when ``like`` does (the same storage: what the load reads into ``t`` is there)."""
    if isinstance(like, torch.nn.Parameter):
        return torch.nn.Parameter(t, requires_grad=like.requires_grad)
    return t.requires_grad_(like.requires_grad) if like.requires_grad else t


TENSOR_VALUE = "tensor:"  # + checkpoint key: a loaded tensor of a Stateful, in ``apply``'s values
_SPLIT, _SPLIT_ESCAPED = "replicated", "replicated.escaped"  # the replicated blob, without / with escapes


def _replicated_what(md: Metadata) -> str:
    """What ``apply`` calls a checkpoint's replicated blob: which ``join_tensors`` rules it follows."""
    return _SPLIT_ESCAPED if escapes_dicts(md.objects) else _SPLIT


@dataclass(frozen=True, eq=False)
class PerRankItem(StatefulItem):
    """``unickpt.PerRank(obj)``: ``value`` is the ``PerRank``; each rank's ``state_dict()``,
    tensors included, in its per-rank blob. Loads a replicated save too (its tensors resharded)."""

    kind: ClassVar[Kind] = Kind.PER_RANK

    @property
    def obj(self) -> Any:
        return self.value.obj

    def encode(self, rank: int) -> Encoded:
        data = encode_value(_state_dict(self.key, self.obj), f"state[{self.key!r}].state_dict()")
        return Encoded({extra_blob_key(rank, self.key): data})

    def choose(self, ctx: LoadContext) -> tuple[dict[str, str], list[str]]:
        _check_saved_list(ctx.md, self.key, None)
        if replicated_blob_key(self.key) in ctx.blob_keys and not _has_per_rank(self.key, ctx):
            return {_replicated_what(ctx.md): replicated_blob_key(self.key)}, []
        return _per_rank_choice(self.key, ctx)


CLAIM_PREFIX = "replicated state "


def claim_name(key: str) -> str:
    return f"{CLAIM_PREFIX}{key!r}"


_REPLICATED, _PART = "replicated", "part."


@dataclass(frozen=True, eq=False)
class LoaderItem(StateItem):
    """``state["dataloader"]`` (``state.loader``): protocol loaders or per-rank ``state_dict``."""

    kind: ClassVar[Kind] = Kind.DATALOADER

    def encode(self, rank: int) -> Encoded:
        loader = self.value
        if is_reshardable(loader):  # the unickpt.data protocol: replicated state + numbered parts
            return Encoded({k: encode_value(v, k) for k, v in loader_blobs(loader).items()})
        if not hasattr(loader, "state_dict"):
            raise FrameworkError(
                'state["dataloader"] must implement the unickpt.data protocol or have state_dict()/load_state_dict()'
            )
        return Encoded({f"{LEGACY_PREFIX}{rank}": encode_value(loader.state_dict(), "dataloader")})

    def choose(self, ctx: LoadContext) -> tuple[dict[str, str], list[str]]:
        loader, md = self.value, ctx.md
        if is_reshardable(loader):
            if LOADER_SECTION in md.sections:
                return _protocol_loader_keys(md, loader), []
            if any(k.startswith(LEGACY_PREFIX) for k in ctx.blob_keys):
                raise LoaderStateError(
                    f"the checkpoint holds per-rank state of a loader without the unickpt.data protocol; this "
                    f"{type(loader).__name__} cannot take it: load without state['dataloader'] and start it fresh"
                )
            return {}, [self.key]
        key = _legacy_loader_key(ctx)
        if key is None:
            return {}, [self.key] if ctx.loader_on_resize == "error" else []
        return {"legacy": key}, []

    def apply(self, state: MutableMapping[str, Any], values: Mapping[str, Any]) -> None:
        loader = self.value
        if _REPLICATED in values:
            replicated = values[_REPLICATED]
            parts = {int(k[len(_PART) :]): v for k, v in values.items() if k.startswith(_PART)}
            loader.load_unickpt_state(replicated["state"], parts, int(replicated["dp_size"]))
        if "legacy" in values:
            loader.load_state_dict(values["legacy"])


def _protocol_loader_keys(md: Metadata, loader: Any) -> dict[str, str]:
    """Every blob of the saved loader state (replicated + all parts) for a protocol loader."""
    index = md.sections[LOADER_SECTION]
    assert isinstance(index, LoaderIndex)
    own = getattr(loader, "num_parts", index.num_parts)
    if own != index.num_parts:
        raise LoaderStateError(
            f"the checkpoint's loader state has {index.num_parts} parts, this {type(loader).__name__} has {own}: "
            "build the loader with the same num_parts to resume without losing or repeating data"
        )
    out = {_REPLICATED: index.replicated}
    out.update({f"{_PART}{p}": k for p, k in enumerate(index.parts)})
    return out


def _legacy_loader_key(ctx: LoadContext) -> str | None:
    """This rank's own per-rank blob of a loader without the protocol (same world size only)."""
    saved = ctx.md.topology.world_size
    if saved != ctx.world_size:
        if ctx.loader_on_resize == "skip":
            if ctx.rank == 0:
                warnings.warn(
                    f"dataloader state not restored: saved by {saved} ranks, loading on {ctx.world_size} "
                    "(LoadOptions(restore=RestoreOptions(loader_on_resize='skip'))); the loaders start where they are",
                    stacklevel=6,
                )
            return None
        raise LoaderStateError(
            f"the checkpoint holds per-rank dataloader state of {saved} ranks and this job has "
            f"{ctx.world_size}: a loader without the unickpt.data protocol cannot be split or merged "
            "without repeating or dropping data. Implement the protocol (unickpt.data, e.g. "
            "TokenPackingLoader), or pass LoadOptions(restore=RestoreOptions(loader_on_resize='skip')) to start the "
            "loaders fresh"
        )
    key = f"{LEGACY_PREFIX}{ctx.rank}"
    return key if key in ctx.blob_keys else None
