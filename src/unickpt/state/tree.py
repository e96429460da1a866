"""A ``Stateful``'s ``state_dict()`` as a tree of plain values and tensors: split at save into the
plain part (one blob, the safe value encoding) and its tensors (checkpoint tensors ``<key>.<path>``,
which reshard), joined back at load. ``state.items.StatefulItem`` calls both.

A tensor's place in the plain part is a placeholder ``{"__unickpt_tensor__": "<checkpoint key>"}``.
A user dict that would read as a placeholder (or as an escape) is saved escaped,
``{"__unickpt_dict__": {...the dict...}}``, and comes back exactly. Checkpoints whose metadata
object ``state_encoding`` says ``escaped_dicts`` (``ENCODING``, written from this release on) are
joined with the escapes undone; older ones as they were written (no user dict was escaped). The
same object records the length of each list of Statefuls under one key (``lists``: key -> length,
``list_lengths``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CorruptMetadataError, FrameworkError, UnsupportedValueError
from ..format.records import JSONValue
from ..format.values import check_size

__all__ = ["split_tensors", "join_tensors", "escapes_dicts", "list_lengths", "STATE_ENCODING_OBJECT", "ENCODING"]

_MARK = "__unickpt_tensor__"  # a placeholder: {_MARK: checkpoint key}
_ESCAPE = "__unickpt_dict__"  # an escaped user dict: {_ESCAPE: the user's dict}
STATE_ENCODING_OBJECT = "state_encoding"  # the metadata object naming the rules of the blobs below
ENCODING: dict[str, JSONValue] = {"escaped_dicts": 1}


def escapes_dicts(objects: Mapping[str, Any]) -> bool:
    """Whether a checkpoint with these metadata ``objects`` escaped user dicts (module docstring)."""
    enc = objects.get(STATE_ENCODING_OBJECT)
    return isinstance(enc, dict) and enc.get("escaped_dicts") == 1


def list_lengths(objects: Mapping[str, Any]) -> dict[str, int]:
    """Key -> length of each list of Statefuls a checkpoint with these ``objects`` saved
    (``state_encoding``'s ``lists``; empty for older checkpoints)."""
    enc = objects.get(STATE_ENCODING_OBJECT)
    lists = enc.get("lists") if isinstance(enc, dict) else None
    if not isinstance(lists, dict):
        return {}
    return {k: n for k, n in lists.items() if isinstance(k, str) and type(n) is int}


def split_tensors(key: str, value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``value`` with every tensor (at any depth of dicts, lists, tuples) replaced by a placeholder
    and every user dict that has a reserved key escaped, and those tensors by checkpoint key.
    Measured first (``format.values.check_size``): shared sub-structures are refused with their
    size instead of walked once per reference."""
    try:
        check_size(value, f"state[{key!r}].state_dict()", tensors_inline=False)
    except TypeError as e:
        raise UnsupportedValueError(f"cannot save {e}") from e
    found: dict[str, torch.Tensor] = {}

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            ckey = f"{key}.{path}" if path else key
            if ckey in found:
                raise FrameworkError(f"state[{key!r}].state_dict(): two tensors are both named {ckey!r}")
            found[ckey] = v
            return {_MARK: ckey}
        if type(v) is dict:
            out = {k: walk(x, f"{path}.{k}" if path else str(k)) for k, x in v.items()}
            return {_ESCAPE: out} if _MARK in v or _ESCAPE in v else out
        if type(v) in (list, tuple):
            return type(v)(walk(x, f"{path}.{i}" if path else str(i)) for i, x in enumerate(v))
        return v

    return walk(value, ""), found


def join_tensors(value: Any, tensors: Mapping[str, torch.Tensor], key: str, escaped: bool = False) -> Any:
    """The inverse of ``split_tensors``: placeholders replaced by the loaded tensors; with
    ``escaped`` (``escapes_dicts`` of the checkpoint) escaped user dicts unwrapped."""

    def walk(v: Any) -> Any:
        if type(v) is dict:
            if len(v) == 1 and _MARK in v:
                t = tensors.get(v[_MARK]) if isinstance(v[_MARK], str) else None
                if t is None:
                    raise CorruptMetadataError(f"state[{key!r}]: tensor {v[_MARK]!r} is not in the checkpoint")
                return t
            if escaped and len(v) == 1 and type(v.get(_ESCAPE)) is dict:
                return {k: walk(x) for k, x in v[_ESCAPE].items()}
            return {k: walk(x) for k, x in v.items()}
        if type(v) in (list, tuple):
            return type(v)(walk(x) for x in v)
        return v

    return walk(value)
