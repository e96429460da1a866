"""A ``state`` dict as the pipelines use it: one ``StateItem`` per key (``state.items``), and the
one model and one optimizer the framework adapter describes.

Order of use (every rank):
  save  ``SavePipeline.describe``: ``StateLayout.of(state)`` (keys and values checked before
        anything is written) -> ``adapter = get_framework(name, layout.framework_state)`` ->
        ``adapter.save_view(layout.framework_state)`` -> ``layout.encode(rank)`` (blobs, claims:
        checked in the describe collective; ``replicated_disagreement`` words a failure) ->
        ``layout.objects()`` go into the metadata (each key and its kind).
  load  ``LoadPipeline``: ``StateLayout.of(state)`` -> the adapter's ``load_view`` ->
        ``layout.choose(ctx)`` and ``layout.keys_against(md)`` in the validate stage -> blobs
        read -> ``layout.apply(state, values)`` after the view applied the tensors.

Keys: a name of letters, digits, ``_``, ``-`` and ``.`` (at most 128). ``"model"``,
``"optimizer"`` and ``"dataloader"`` keep their meaning (``"model"`` and ``"optimizer"`` go to the
adapter as they are when they are the only module / optimizer, so every adapter sees what it
saw before); any other key's kind follows from its value (``layout.item_for``).

The metadata records the saved keys in the object ``state_keys`` (key -> kind; the union of the
ranks', ``planning.objects``; older checkpoints lack it). Strict per key: a key of a checkpoint
that records its keys and that the live state lacks is unexpected (except ``model``,
``optimizer`` and ``extra_state``: a state may load the weights alone); a live key the
checkpoint lacks is missing (blob kinds through ``choose``; modules and optimizers through their
tensors and param groups).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import FrameworkError, RankDisagreementError
from ..format.records import JSONValue, Metadata
from ..frameworks.base import OPTIM_PREFIX, is_optimizer_like
from ..frameworks.parts import MODEL_KEY, ModelParts, OptimizerChain, part_prefix, unwrap_optimizer
from ..planning.objects import STATE_KEYS_OBJECT
from ..planning.specs import LoadItem, SaveItem
from .items import (
    CLAIM_PREFIX,
    TENSOR_VALUE,
    Encoded,
    Kind,
    LoadContext,
    LoaderItem,
    ModuleItem,
    OptimizerItem,
    PerRank,
    PerRankItem,
    StatefulItem,
    StatefulListItem,
    StateItem,
    ValueItem,
    _is_stateful,
)
from .loader import LEGACY_PREFIX, LOADER_SECTION
from .tree import ENCODING, STATE_ENCODING_OBJECT

__all__ = ["StateLayout", "item_for", "check_key", "saved_keys", "replicated_disagreement"]

_REPLICATED = (Kind.STATEFUL, Kind.STATEFUL_LIST)  # saved once, claimed equal on every rank
_OWN_TENSORS = (*_REPLICATED, Kind.PER_RANK)  # kinds whose tensors this layout loads (not the adapter)
_KEY = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
OPTIMIZER_KEY, LOADER_KEY = "optimizer", "dataloader"
# keys a live state may leave out without the checkpoint's being unexpected (a load of the weights
# alone, without the optimizer or extra state, as every release allowed)
OPTIONAL_KEYS = frozenset({MODEL_KEY, OPTIMIZER_KEY, "extra_state"})


def check_key(key: object) -> str:
    """``key`` if it is a valid state key, else ``FrameworkError`` naming it."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise FrameworkError(
            f"invalid state key {key!r}: a state key is a name of 1-128 letters, digits, '_', '-' and '.'"
        )
    return key


def _modules(value: object) -> bool:
    if isinstance(value, nn.Module):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, nn.Module) for m in value)


def _optimizers(value: object) -> bool:
    if is_optimizer_like(value) or isinstance(getattr(value, "optimizers", None), (list, tuple)):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and all(is_optimizer_like(o) for o in value)


def item_for(key: str, value: Any) -> StateItem | None:
    """The item of ``state[key]`` (None: nothing to save or load, e.g. ``"model": None``)."""
    if key == LOADER_KEY:
        return LoaderItem(key, value) if value is not None else None
    if key == MODEL_KEY:
        return ModuleItem(key, value) if value is not None else None  # the adapter checks it
    if key == OPTIMIZER_KEY or (value is not None and _optimizers(value)):
        if value is None:
            return None
        if isinstance(value, (list, tuple)):
            for i, o in enumerate(value):
                if not is_optimizer_like(o):
                    raise FrameworkError(f"state[{key!r}][{i}] is not an optimizer ({type(o).__name__})")
            found = [x for i, o in enumerate(value) for x in unwrap_optimizer(o, f"state[{key!r}][{i}]")]
        else:
            found = unwrap_optimizer(value, f"state[{key!r}]")
        return OptimizerItem(key, value, tuple(found))
    if _modules(value):
        return ModuleItem(key, value)
    if isinstance(value, PerRank):
        return PerRankItem(key, value)
    if _is_stateful(value):
        return StatefulItem(key, value)
    if _statefuls(key, value):
        return StatefulListItem(key, value)
    return ValueItem(key, value)


def _statefuls(key: str, value: Any) -> bool:
    """Whether ``value`` is a list (or tuple) of Statefuls (``FrameworkError`` for a list that
    mixes them with modules, optimizers or plain values: each kind goes under its own key)."""
    if type(value) not in (list, tuple) or not value or not any(_is_stateful(v) for v in value):
        return False
    for i, v in enumerate(value):
        if not _is_stateful(v) or isinstance(v, nn.Module) or is_optimizer_like(v):
            raise FrameworkError(
                f"state[{key!r}][{i}] is a {type(v).__name__}: a list under one key holds Stateful objects "
                "only (modules, optimizers and plain values each under a key of their own)"
            )
    return True


@dataclass(frozen=True, eq=False)
class StateLayout:
    """The items of one ``state`` dict and what the framework adapter describes."""

    items: tuple[StateItem, ...]
    framework_state: dict[str, Any]

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> StateLayout:
        """Check every key and value's kind (nothing is encoded yet); FrameworkError naming the
        key for what cannot be part of a state."""
        if not isinstance(state, MutableMapping):
            raise FrameworkError(f"state must be a dict, got {type(state).__name__}")
        items = tuple(i for k, v in state.items() if (i := item_for(check_key(k), v)) is not None)
        return cls(items, _framework_state(items))

    # ------------------------------------------------------------------ save

    def encode(self, rank: int) -> Encoded:
        """Every item's blobs and claims on this rank (``UnsupportedValueError`` naming a path)."""
        blobs: dict[str, bytes] = {}
        claims: dict[str, str] = {}
        tensors: list[SaveItem] = []
        for item in self.items:
            if not item.by_adapter:
                enc = item.encode(rank)
                blobs.update(enc.blobs)
                claims.update(enc.claims)
                tensors += enc.tensors
        replicated = sorted(i.key for i in self.items if i.kind in _REPLICATED)
        claims["replicated state keys"] = repr(replicated)
        return Encoded(blobs, claims, tensors)

    def objects(self) -> dict[str, JSONValue]:
        """The metadata objects recording each key and its kind, and (with a replicated Stateful)
        the rules its blob follows (``state.tree``)."""
        out: dict[str, JSONValue] = {STATE_KEYS_OBJECT: {i.key: i.kind.value for i in self.items}}
        if any(i.kind in _REPLICATED for i in self.items):
            encoding = dict(ENCODING)
            lists: dict[str, JSONValue] = {i.key: len(i.value) for i in self.items if i.kind is Kind.STATEFUL_LIST}
            if lists:
                encoding["lists"] = lists
            out[STATE_ENCODING_OBJECT] = encoding
        return out

    @property
    def optimizer(self) -> Any:
        """The optimizer the adapter describes (one, a chain view, or None)."""
        return self.framework_state.get(OPTIMIZER_KEY)

    # ------------------------------------------------------------------ load

    def choose(self, ctx: LoadContext) -> tuple[dict[tuple[str, str], str], list[str]]:
        """((item key, what) -> blob key to read, missing keys) over the blob-saved items."""
        chosen: dict[tuple[str, str], str] = {}
        missing: list[str] = []
        for item in self.items:
            picked, absent = item.choose(ctx)
            chosen.update({(item.key, what): blob for what, blob in picked.items()})
            missing += absent
        return chosen, missing

    def destinations(self, md: Metadata) -> tuple[list[LoadItem], dict[tuple[str, str], Any], tuple[str, ...]]:
        """The items' tensors loaded through the tensor path: (destinations, (item key,
        ``tensor:<checkpoint key>``) -> the tensor ``apply`` receives, the key prefixes they cover)."""
        items: list[LoadItem] = []
        values: dict[tuple[str, str], Any] = {}
        prefixes: list[str] = []
        for item in self.items:
            if item.kind in _OWN_TENSORS:
                prefixes.append(f"{item.key}.")
                dest, fresh = item.destinations(md)
                items += dest
                values.update({(item.key, f"{TENSOR_VALUE}{k}"): t for k, t in fresh.items()})
        return items, values, tuple(prefixes)

    def keys_against(self, md: Metadata) -> tuple[list[str], list[str]]:
        """Top-level keys: (live keys the checkpoint lacks, checkpoint keys the live state lacks);
        empty for a checkpoint that does not record its keys (older releases), except loader
        state that no live loader takes."""
        live = {i.key for i in self.items}
        recorded = saved_keys(md)
        if recorded is None:
            has_loader = LOADER_SECTION in md.sections or any(k.startswith(LEGACY_PREFIX) for k in md.blobs)
            return [], [LOADER_KEY] if has_loader and LOADER_KEY not in live else []
        # a module or optimizer the checkpoint lacks shows as its missing tensors and param groups
        return [], sorted(recorded - live - OPTIONAL_KEYS)

    def apply(self, state: MutableMapping[str, Any], values: Mapping[tuple[str, str], Any]) -> None:
        """Every blob-saved item's values into the live state (the loader first: it can still refuse)."""
        ordered = sorted(self.items, key=lambda i: i.kind is not Kind.DATALOADER)
        for item in ordered:
            mine = {what: v for (k, what), v in values.items() if k == item.key}
            if mine:
                item.apply(state, mine)


def _check_prefixes(items: tuple[StateItem, ...]) -> None:
    """The checkpoint tensor keys of the items that have some (modules, Stateful objects) stay
    apart: no key's prefix inside another's, none inside ``optimizer.``."""
    prefixes = {i.key: part_prefix(i.key) for i in items if i.kind in (Kind.MODULE, *_OWN_TENSORS)}
    for a, pa in prefixes.items():
        if pa.startswith(OPTIM_PREFIX):
            raise FrameworkError(f"state key {a!r}: the key of a module or Stateful cannot start with 'optimizer.'")
        clash = [b for b, pb in prefixes.items() if b != a and pb.startswith(pa)]
        if clash:
            raise FrameworkError(
                f"state keys {a!r} and {clash[0]!r}: the checkpoint keys of one would be among the other's"
            )


def _framework_state(items: tuple[StateItem, ...]) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` for the adapter (see the module docstring)."""
    _check_prefixes(items)
    modules = [i for i in items if isinstance(i, ModuleItem)]
    out: dict[str, Any] = {}
    if len(modules) == 1 and modules[0].key == MODEL_KEY:
        out[MODEL_KEY] = modules[0].value
    elif modules:
        parts = []
        for i in modules:
            values = i.value if isinstance(i.value, (list, tuple)) else [i.value]
            parts += [(i.key, m) for m in values]
        out[MODEL_KEY] = ModelParts(tuple(parts))
    optimizers = [o for i in items if isinstance(i, OptimizerItem) for o in i.optimizers]
    if len(optimizers) == 1:
        out[OPTIMIZER_KEY] = optimizers[0]
    elif optimizers:
        out[OPTIMIZER_KEY] = OptimizerChain(tuple(optimizers))
    return out


def saved_keys(md: Metadata) -> set[str] | None:
    """The top-level keys a checkpoint records (None: saved by a release that did not record them)."""
    keys = md.objects.get(STATE_KEYS_OBJECT)
    if not isinstance(keys, dict):
        return None
    return {k for k in keys if isinstance(k, str)}


def replicated_disagreement(err: RankDisagreementError) -> RankDisagreementError | None:
    """A clearer error when the ranks disagreed on replicated state (None: another disagreement)."""
    values = getattr(err, "values", None) or {}
    ours = {what: by_rank for what, by_rank in values.items() if what.startswith(CLAIM_PREFIX) or "state keys" in what}
    if not ours:
        return None
    lines = []
    for what, by_rank in ours.items():
        groups: dict[str, list[int]] = {}
        for r, v in sorted(by_rank.items()):
            groups.setdefault(v, []).append(r)
        sets = "; ".join(f"ranks {rs}" if len(rs) > 1 else f"rank {rs[0]}" for rs in groups.values())
        lines.append(f"  {what.removeprefix(CLAIM_PREFIX)}: {len(groups)} different values ({sets})")
    return RankDisagreementError(
        "save refused before anything was written: replicated state (a Stateful saved once) differs between "
        "ranks; make it equal on every rank, or mark it unickpt.PerRank(obj) to save each rank's own:\n"
        + "\n".join(lines),
        ours,
    )
