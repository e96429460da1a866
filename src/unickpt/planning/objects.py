"""Merge the ranks' JSON objects into the checkpoint's (a pure function, run by rank 0 at commit).

Every rank's adapter describes its non-tensor state as JSON objects (``SaveView.objects``); they
travel to rank 0 with the checksums that the commit gathers anyway (no extra round trip) and are
merged here into the one ``Metadata.objects``:

* ``optimizer`` is merged per parameter: ranks may hold different parameters (pipeline stages)
  with different hyper-parameters. The result lists each distinct hyper-parameter set once, with
  the parameters (fqns) that use it, so identical objects of data-parallel replicas do not
  multiply the metadata. Ranks that hold the same parameter must agree on its hyper-parameters
  and non-tensor state values, else ``PlanningError`` names both ranks.
* ``state_keys`` (the ``state`` keys each rank saved -> their kind, ``state.layout``) is the
  union of the ranks' (ranks may hold different keys: a loader on some ranks only); a key saved
  with two kinds is a ``PlanningError``.
* any other object must be identical on every rank that has it.

The merged ``optimizer`` object keeps the layout that earlier checkpoints already have
(``{"param_groups": [{<hyper-parameters>, "params": [fqn, ...]}, ...], "state_values": {fqn:
{name: value}}}``), so readers treat old (rank 0 only) and merged objects alike.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import PlanningError
from ..format.records import JSONValue

__all__ = ["merge_rank_objects", "OPTIMIZER_OBJECT", "STATE_KEYS_OBJECT"]

OPTIMIZER_OBJECT = "optimizer"
STATE_KEYS_OBJECT = "state_keys"


def _canonical(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def _brief(hyper: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={_canonical(v)}" for k, v in sorted(hyper.items()))
    return text if len(text) <= 200 else text[:200] + "..."


class _OptimizerMerge:
    """Accumulates the ranks' ``optimizer`` objects (encoded JSON) parameter by parameter."""

    def __init__(self) -> None:
        self.sets: list[dict[str, Any]] = []  # distinct hyper-parameter sets
        self.index: dict[str, int] = {}  # canonical text -> position in ``sets``
        self.params: list[list[str]] = []  # per set: the fqns using it, first-seen order
        self.owner: dict[str, tuple[int, int]] = {}  # fqn -> (set, first rank)
        self.values: dict[str, tuple[str, JSONValue, int]] = {}  # fqn -> (canonical, value, rank)

    def add(self, rank: int, obj: Any) -> None:
        """Fold in rank ``rank``'s encoded ``optimizer`` object (untrusted shape: checked)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("param_groups"), list):
            raise PlanningError(f"rank {rank}: malformed optimizer object (no 'param_groups' list)")
        for group in obj["param_groups"]:
            if not isinstance(group, dict) or not isinstance(group.get("params"), list):
                raise PlanningError(f"rank {rank}: malformed optimizer param group")
            hyper = {k: v for k, v in group.items() if k != "params"}
            text = _canonical(hyper)
            s = self.index.get(text)
            if s is None:
                s = self.index[text] = len(self.sets)
                self.sets.append(hyper)
                self.params.append([])
            for fqn in group["params"]:
                if not isinstance(fqn, str):
                    raise PlanningError(f"rank {rank}: malformed optimizer param group (a non-str parameter name)")
                seen = self.owner.get(fqn)
                if seen is None:
                    self.owner[fqn] = (s, rank)
                    self.params[s].append(fqn)
                elif seen[0] != s:
                    raise PlanningError(
                        f"optimizer parameter {fqn!r} has different hyper-parameters on rank {seen[1]} "
                        f"({_brief(self.sets[seen[0]])}) and on rank {rank} ({_brief(hyper)}); ranks "
                        "holding the same parameter must use the same param-group settings"
                    )
        values = obj.get("state_values", {})
        if not isinstance(values, dict):
            raise PlanningError(f"rank {rank}: malformed optimizer object ('state_values' is not a dict)")
        for fqn, v in values.items():
            text = _canonical(v)
            seen_v = self.values.get(fqn)
            if seen_v is None:
                self.values[fqn] = (text, v, rank)
            elif seen_v[0] != text:
                raise PlanningError(
                    f"optimizer state of parameter {fqn!r} differs between rank {seen_v[2]} and rank {rank} "
                    f"({seen_v[0][:120]} vs {text[:120]})"
                )

    def result(self) -> JSONValue:
        groups: list[JSONValue] = [{**h, "params": list(p)} for h, p in zip(self.sets, self.params) if p]
        return {"param_groups": groups, "state_values": {f: v for f, (_, v, _) in self.values.items()}}


def merge_rank_objects(per_rank: list[dict[str, JSONValue]]) -> dict[str, JSONValue]:
    """One objects dict from every rank's (index = rank); see the module docstring."""
    merged: dict[str, JSONValue] = {}
    first: dict[str, tuple[str, int]] = {}
    optim: _OptimizerMerge | None = None
    seen_texts: set[str] = set()  # identical optimizer objects (DP replicas) are merged once
    keys: dict[str, tuple[JSONValue, int]] | None = None
    for rank, objects in enumerate(per_rank):
        for key, value in objects.items():
            if key == STATE_KEYS_OBJECT:
                if not isinstance(value, dict):
                    raise PlanningError(f"rank {rank}: malformed {STATE_KEYS_OBJECT} object")
                keys = {} if keys is None else keys
                for k, kind in value.items():
                    seen = keys.setdefault(k, (kind, rank))
                    if seen[0] != kind:
                        raise PlanningError(
                            f"state[{k!r}] is a {seen[0]} on rank {seen[1]} and a {kind} on rank {rank}"
                        )
                continue
            if key == OPTIMIZER_OBJECT:
                text = _canonical(value)
                if text in seen_texts:
                    continue
                seen_texts.add(text)
                optim = optim or _OptimizerMerge()
                optim.add(rank, value)
                continue
            text = _canonical(value)
            if key not in first:
                first[key] = (text, rank)
                merged[key] = value
            elif first[key][0] != text:
                raise PlanningError(f"object {key!r} differs between rank {first[key][1]} and rank {rank}")
    if optim is not None:
        merged[OPTIMIZER_OBJECT] = optim.result()
    if keys is not None:
        merged[STATE_KEYS_OBJECT] = {k: kind for k, (kind, _) in sorted(keys.items())}
    return merged
