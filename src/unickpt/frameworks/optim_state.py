"""Optimizer state from a checkpoint into a live optimizer: the rollback-safe load, for every adapter.

A load replaces the optimizer's state by the checkpoint's, as ``Optimizer.load_state_dict``
does: for every live parameter the checkpoint covers (its param groups list it, or it has saved
state), ``optimizer.state[p]`` becomes exactly the saved state: the saved tensors (read into the
live tensor of that name when there is one, else into a fresh tensor laid out like the live
parameter), the saved non-tensor values, and nothing else. A parameter saved without state (a
checkpoint taken before the first ``step()``, a parameter that never had a gradient) ends with
none. Gradients are never touched and ``step()`` is never called (closure optimizers like LBFGS
load like any other). Each live param group takes the hyper-parameters saved for its parameters.

Fresh tensors follow the checkpoint's records: a saved state of the parameter's global shape is
laid out like the parameter's local shard (``ParamState.like``: a DTensor with the parameter's
mesh and placements, FSDP1's flat slice, a plain tensor), with the saved dtype, on the
parameter's device; a 0-d state (Adam's ``step``) is a 0-d tensor on the CPU, or on the
parameter's device when the group is ``capturable`` or ``fused`` (as torch's optimizers keep it);
any other shape is a full tensor on the parameter's device.

The optimizer is duck-typed (``base.OptimizerLike``): only ``param_groups``, ``state`` and, if
present, ``defaults`` are used. Parameter layouts come from the adapter's description
(``base.OptimizerDescription``: one ``ParamState`` per parameter), never from the model again.

Order of use (``views.load_view``, from the adapter's ``load_view``; every rank):
  1. ``OptimizerLoad(desc, saved, strict, targets)``: picks or allocates every destination from
     the checkpoint's records (``read_saved``) and adds their pieces to ``targets``
     (``targets.LoadTargets``); nothing in the optimizer changes. ``targets.items`` go to the
     engine; ``targets.probes`` (FSDP1 flat steps, one scratch scalar per original parameter)
     are read before validation;
  2. ``validate()``: param-group coverage and hyper-parameters (``param_groups``); returns
     the (missing, unexpected) keys; raises on what cannot be loaded;
  3. the engine fills ``targets.items`` (only after every rank validated);
  4. ``apply()``: installs the state and the hyper-parameters.
``views.load_view`` checks the probes after step 2 and copies them before step 4.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CorruptMetadataError, FrameworkError, SizeLimitError
from ..format.dtypes import dtype_from_name
from ..format.records import Metadata, TensorRecord
from ..format.values import decode_value
from .base import OPTIM_PREFIX, STATE_PREFIX, OptimizerDescription, ParamState
from .module_state import local_tensor
from .param_groups import apply_hyper, hyper_problems, key_set_problem
from .targets import LoadTargets

__all__ = ["SavedOptimizer", "read_saved", "OptimizerLoad", "GROUPS_KEY"]

GROUPS_KEY = f"{OPTIM_PREFIX}param_groups."  # + fqn: a parameter's entry in the param groups


@dataclass(frozen=True, slots=True)
class SavedOptimizer:
    """What a checkpoint records of the optimizer, by parameter fqn."""

    groups: list[dict[str, Any]] = field(default_factory=list)  # distinct hyper-parameter sets
    group_of: dict[str, int] = field(default_factory=dict)  # fqn -> index into ``groups``
    values: dict[str, dict[str, Any]] = field(default_factory=dict)  # fqn -> non-tensor state
    tensors: dict[str, dict[str, TensorRecord]] = field(default_factory=dict)  # fqn -> name -> record

    def covers(self, fqn: str) -> bool:
        return fqn in self.group_of or fqn in self.tensors or fqn in self.values


def read_saved(md: Metadata | None) -> SavedOptimizer:
    """The optimizer records of ``md`` (None: a checkpoint without any). Reads both layouts of
    the ``optimizer`` object: rank 0's groups (older checkpoints) and groups merged per
    parameter across ranks; state tensors are ``optimizer.state.<fqn>.<name>``."""
    if md is None:
        return SavedOptimizer()
    out = SavedOptimizer()
    raw = md.objects.get("optimizer")
    if raw is not None:
        saved = _checked_object(decode_value(raw, "checkpoint object 'optimizer'"))
        for gi, g in enumerate(saved["param_groups"]):
            out.groups.append({k: v for k, v in g.items() if k != "params"})
            for fqn in g["params"]:
                if out.group_of.setdefault(fqn, gi) != gi:
                    raise _bad(f"parameter {fqn!r} is listed in param groups {out.group_of[fqn]} and {gi}")
        out.values.update(saved.get("state_values", {}))
    for key, rec in md.tensors.items():
        if key.startswith(STATE_PREFIX):
            fqn, _, name = key[len(STATE_PREFIX) :].rpartition(".")
            if fqn:
                out.tensors.setdefault(fqn, {})[name] = rec
    return out


def _bad(what: str) -> CorruptMetadataError:
    return CorruptMetadataError(f"checkpoint metadata object 'optimizer' is malformed: {what}")


def _checked_object(saved: Any) -> dict[str, Any]:
    """The decoded ``optimizer`` object, or CorruptMetadataError if its structure is wrong."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise _bad("expected a dict with a 'param_groups' list")
    for gi, g in enumerate(saved["param_groups"]):
        if (
            not isinstance(g, dict)
            or not isinstance(g.get("params"), list)
            or not all(isinstance(p, str) for p in g["params"])
        ):
            raise _bad(f"param group {gi} must be a dict with a 'params' list of names")
        for k, v in g.items():
            if k != "params" and not isinstance(v, (type(None), bool, int, float, str, tuple, list, torch.Tensor)):
                raise _bad(f"param group {gi} entry {k!r} has type {type(v).__name__}")
    values = saved.get("state_values", {})
    if not isinstance(values, dict) or not all(isinstance(v, dict) for v in values.values()):
        raise _bad("'state_values' must map parameter names to dicts")
    return saved


class OptimizerLoad:
    """One load of the checkpoint's optimizer records into a live optimizer (see the module
    docstring for the order of calls). Destinations go to ``targets`` (shared with the model's)."""

    def __init__(self, desc: OptimizerDescription, saved: SavedOptimizer, strict: bool, targets: LoadTargets) -> None:
        self.desc, self.optim, self.saved, self.strict = desc, desc.optimizer, saved, strict
        self.targets = targets
        self._install: list[tuple[torch.Tensor, dict[str, Any]]] = []
        self._updates: list[tuple[dict[str, Any], dict[str, Any]]] = []
        with torch.no_grad():  # destinations are detached views; to_local() is no autograd op then
            for g in self.optim.param_groups:
                for p in g["params"]:
                    ps = desc.params[id(p)]
                    covered = [f for f in ps.fqns if saved.covers(f)]
                    if not covered:
                        continue  # not in the checkpoint: left as it is (missing, see validate)
                    if not ps.holds:
                        self._install.append((p, {}))  # as the uninterrupted run: no state here
                        continue
                    if len(covered) != len(ps.fqns):
                        raise FrameworkError(
                            f"the checkpoint's optimizer covers {covered[:3]} but not "
                            f"{_absent(ps.fqns, covered)[:3]}, which share one flat parameter here; a flat "
                            "parameter's state cannot be loaded in part (use use_orig_params=True)"
                        )
                    self._install.append((p, self._state_for(p, ps, g)))

    def _state_for(self, p: torch.Tensor, ps: ParamState, group: dict[str, Any]) -> dict[str, Any]:
        """The state ``p`` will have: destinations of its saved tensors, then its saved values."""
        fqns = ps.fqns
        saved = [self.saved.tensors.get(f, {}) for f in fqns]
        names = list(saved[0]) if len(saved) == 1 else list(dict.fromkeys(n for s in saved for n in s))
        live = self.optim.state.get(p) or {}
        state: dict[str, Any] = {}
        for name in names:
            recs = [s.get(name) for s in saved]
            if len(recs) > 1 and any(r is None for r in recs):
                have = [f for f, r in zip(fqns, recs) if r is not None]
                raise FrameworkError(
                    f"optimizer state {name!r} is saved for {have[:3]} but not for {_absent(fqns, have)[:3]}, "
                    "which share one flat parameter here; a flat parameter cannot hold state for only some of "
                    "its parameters (use use_orig_params=True)"
                )
            cur = live.get(name)
            fresh = not isinstance(cur, torch.Tensor)
            t = self._fresh(ps, name, [r for r in recs if r is not None], group) if fresh else cur
            assert isinstance(t, torch.Tensor)
            self.targets.add(ps.pieces(name, t), fresh)
            state[name] = t
        for f in fqns:
            if f in self.saved.values:
                state.update({k: v for k, v in self.saved.values[f].items() if k not in state})
                break
        return state

    def _fresh(self, ps: ParamState, name: str, recs: list[TensorRecord], group: dict[str, Any]) -> torch.Tensor:
        """A new tensor for saved state ``name`` of ``ps``, laid out by the checkpoint's records."""
        fqns = ps.fqns
        where = f"{STATE_PREFIX}{fqns[0]}.{name}"
        if len({r.dtype for r in recs}) > 1:
            raise FrameworkError(f"{where}: saved with different dtypes for the parameters of one flat parameter")
        dtype = dtype_from_name(recs[0].dtype)
        like, zeroed = ps.like()
        device = local_tensor(like).device
        shapes = [tuple(r.shape) for r in recs]
        with torch.no_grad():
            if all(s == () for s in shapes):
                on_device = bool(group.get("capturable")) or bool(group.get("fused"))
                return torch.zeros((), dtype=dtype, device=device if on_device else "cpu")
            if all(s == tuple(shape) for s, shape in zip(shapes, ps.shapes)):
                return (torch.zeros_like if zeroed else torch.empty_like)(like, dtype=dtype)
            if len(fqns) > 1:
                raise FrameworkError(
                    f"{where}: saved shape {shapes[0]} is neither a scalar nor the parameter's shape; an "
                    "FSDP1 flat parameter cannot hold it (use use_orig_params=True)"
                )
            # e.g. LBFGS's flat direction: a full tensor of the saved shape, which the metadata
            # alone sizes: bounded by the optimizer's parameters (all of them, concatenated)
            if math.prod(shapes[0]) > self._state_cap():
                raise SizeLimitError(
                    f"{where}: saved shape {shapes[0]} has more elements than all {self._state_cap()} of "
                    "the optimizer's parameters together; refused before allocating (corrupt metadata?)"
                )
            return torch.empty(shapes[0], dtype=dtype, device=device)

    def _state_cap(self) -> int:
        return sum(p.numel() for g in self.optim.param_groups for p in g["params"])

    def validate(self) -> tuple[list[str], list[str]]:
        """Everything about the non-tensor state, before any byte is placed; see module docstring."""
        missing: list[str] = []
        live: set[str] = set()
        problems: list[str] = []
        defaults = getattr(self.optim, "defaults", None)  # optional (see base: the optimizer contract)
        for gi, g in enumerate(self.optim.param_groups):
            firsts: dict[int, str] = {}  # saved set -> the first of this group's fqns using it
            for p in g["params"]:
                for f in self.desc.params[id(p)].fqns:
                    live.add(f)
                    s = self.saved.group_of.get(f)
                    if s is None:
                        missing.append(GROUPS_KEY + f)
                    else:
                        firsts.setdefault(s, f)
            if not firsts:
                continue
            (s, first), *others = firsts.items()
            if others:
                hypers = [self.saved.groups[i] for i in firsts]
                differ = sorted({k for h in hypers for k in h if any(k not in o or o[k] != h[k] for o in hypers)})
                sets = "; ".join(f"{f!r}: {_brief(self.saved.groups[i], differ)}" for i, f in firsts.items())
                msg = (
                    f"optimizer param group {gi} holds parameters saved with different hyper-parameters ({sets}); "
                    "split the group like the checkpoint's"
                )
                if self.strict:
                    raise FrameworkError(msg + " (or pass strict=False to take those of its first parameter)")
                warnings.warn(f"{msg}; strict=False: group {gi} takes those of {first!r}", stacklevel=2)
            hyper = self.saved.groups[s]
            if self.strict and isinstance(defaults, dict):
                clash = key_set_problem(g, defaults, hyper, gi, type(self.optim).__name__)
                if clash:
                    raise FrameworkError(clash)
            problems += hyper_problems(g, hyper, gi, first)
            self._updates.append((g, hyper))
        if problems:
            raise CorruptMetadataError(
                "the checkpoint's optimizer hyper-parameters do not fit the live optimizer (nothing was loaded):\n  "
                + "\n  ".join(problems[:20])
                + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
            )
        unexpected = [GROUPS_KEY + f for f in self.saved.group_of if f not in live and f not in self.saved.tensors]
        return missing, unexpected

    def apply(self) -> None:
        """Install the state and hyper-parameters (after every rank validated and read)."""
        with torch.no_grad():
            for p, state in self._install:
                if state:
                    self.optim.state[p] = state
                else:
                    self.optim.state.pop(p, None)
            for g, hyper in self._updates:
                apply_hyper(g, hyper)


def _absent(fqns: tuple[str, ...], have: list[str]) -> list[str]:
    return [f for f in fqns if f not in have]


def _brief(hyper: dict[str, Any], differ: list[str] | None = None) -> str:
    """A few hyper-parameters of a saved group: those in ``differ`` (where groups differ), else
    the usual ones."""
    keys = [k for k in (differ or ()) if k in hyper][:4]
    keys = keys or [k for k in ("lr", "betas", "momentum", "weight_decay", "eps") if k in hyper] or sorted(hyper)[:4]
    return ", ".join(f"{k}={hyper[k]!r}" for k in keys)
