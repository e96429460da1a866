"""Renaming a checkpoint's keys as it is read (``LoadOptions(restore=RestoreOptions(key_map=...))``,
``unickpt modify``).

``remap(md, key_map)`` returns the metadata with every tensor key ``k`` replaced by
``key_map(k)`` (None drops the tensor; shards and bytes are untouched, so nothing is read
twice). Parameter names inside the ``optimizer`` object (param groups, non-tensor state values)
are mapped as the keys ``model.<fqn>`` would be, so an optimizer follows its model's renames.
Two keys mapped to one name, or a result that is no key, raise ``PlanningError``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..errors import PlanningError
from .records import Metadata

__all__ = ["KeyMap", "remap"]

KeyMap = Callable[[str], "str | None"]


def _checked(key_map: KeyMap, key: str) -> str | None:
    new = key_map(key)
    if new is not None and (not isinstance(new, str) or not new):
        raise PlanningError(f"key_map({key!r}) returned {new!r}: a non-empty str or None")
    return new


def _map_fqn(key_map: KeyMap, fqn: str) -> str | None:
    new = _checked(key_map, f"model.{fqn}")
    if new is None:
        return None
    return new[len("model.") :] if new.startswith("model.") else new


def _map_optimizer(obj: Any, key_map: KeyMap) -> Any:
    if not isinstance(obj, dict):
        return obj
    out = dict(obj)
    groups = []
    for group in obj.get("param_groups", []):
        if isinstance(group, dict) and isinstance(group.get("params"), list):
            names = (_map_fqn(key_map, p) for p in group["params"] if isinstance(p, str))
            groups.append({**group, "params": [m for m in names if m is not None]})
        else:
            groups.append(group)
    if "param_groups" in obj:
        out["param_groups"] = groups
    values = obj.get("state_values")
    if isinstance(values, dict):
        mapped = {}
        for fqn, v in values.items():
            new = _map_fqn(key_map, fqn)
            if new is not None:
                mapped[new] = v
        out["state_values"] = mapped
    return out


def remap(md: Metadata, key_map: KeyMap | None) -> Metadata:
    """``md`` with renamed keys (see the module docstring); ``md`` itself when ``key_map`` is None."""
    if key_map is None:
        return md
    tensors = {}
    origin: dict[str, str] = {}
    for key, rec in md.tensors.items():
        new = _checked(key_map, key)
        if new is None:
            continue
        if new in origin:
            raise PlanningError(f"key_map maps both {origin[new]!r} and {key!r} to {new!r}")
        origin[new] = key
        tensors[new] = replace(rec, fqn=new)
    objects = dict(md.objects)
    if "optimizer" in objects:
        objects["optimizer"] = _map_optimizer(objects["optimizer"], key_map)
    return replace(md, tensors=tensors, objects=objects)
