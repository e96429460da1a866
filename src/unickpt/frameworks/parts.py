"""Several modules and several optimizers seen as one model and one optimizer by the adapters.

``state.layout`` builds these from a ``state`` dict (any keys) before it resolves the adapter, so
that every adapter keeps describing one ``state["model"]`` and one ``state["optimizer"]``:

* ``ModelParts``: the modules of every module-valued key, each part with the key it came from.
  A module of key ``"model"`` is named as it reports its names (checkpoint keys ``model.<fqn>``,
  optimizer state by ``<fqn>``); a module of another key ``K`` (``"ema"``, ``"teacher"``) gets
  ``K.<fqn>`` everywhere (checkpoint keys ``K.<fqn>``, optimizer state by ``K.<fqn>``). Parts carry
  no index prefix, so parts [layers 0-1] and [layers 2-3] load into one module holding all four
  layers and back. The generic adapters (``torch``, ``ddp``, ``fsdp2``, ``dtensor``) read it.
* ``OptimizerChain``: several optimizers as one optimizer-like view (``base.OptimizerLike``):
  ``param_groups`` is every optimizer's groups in order (the same dicts), ``state`` a mapping
  that sends each parameter to the optimizer holding it. Since param groups are recorded per
  parameter, two optimizers (one per part) load into one optimizer with two groups and back.

Wrapper optimizers (``unwrap_optimizer``), the documented rule:
  1. an object with inner optimizers in ``optimizers`` (a non-empty list or tuple of
     optimizer-like objects: torchtitan's ``OptimizersContainer``) whose own ``state`` is empty
     or absent stands for its inner optimizers (the rule applied again to each of them);
  2. any other optimizer-like object is used as it is: plain optimizers, and wrappers whose
     ``state`` and ``param_groups`` delegate to the inner optimizer (HF Accelerate's
     ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``; Megatron's ``ChainedOptimizer``,
     whose inner optimizers the ``megatron`` adapter reads), except that
  3. an object with parameters whose own ``state`` is empty while one of its attributes holds an
     optimizer with another ``state`` mapping (it wraps an optimizer without delegating, and not
     by rule 1) is refused (``FrameworkError``): saving it would record no optimizer state.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import FrameworkError
from .base import MODEL_PREFIX, OptimizerLike, is_optimizer_like

__all__ = ["ModelParts", "OptimizerChain", "model_parts", "unwrap_optimizer", "part_prefix", "part_name"]

MODEL_KEY = "model"
_INNER = ("optimizers",)


@dataclass(frozen=True, slots=True, eq=False)
class ModelParts:
    """The modules of a state: (state key, module) in the state's order."""

    parts: tuple[tuple[str, nn.Module], ...]

    def __post_init__(self) -> None:
        for key, m in self.parts:
            if not isinstance(m, nn.Module):
                raise FrameworkError(f"state[{key!r}] must be an nn.Module or a list of them, got {type(m).__name__}")


def part_prefix(key: str) -> str:
    """The checkpoint key prefix of the tensors of a module under state key ``key``."""
    return MODEL_PREFIX if key == MODEL_KEY else f"{key}."


def part_name(key: str, fqn: str) -> str:
    """The name of parameter ``fqn`` of a module under state key ``key`` (optimizer state, groups)."""
    return fqn if key == MODEL_KEY else f"{key}.{fqn}"


def model_parts(model: object) -> list[tuple[str, nn.Module]] | None:
    """(state key, module) for ``state["model"]`` as the adapters receive it: a module, a list or
    tuple of modules (parts of ``"model"``), or ``ModelParts``; None for anything else."""
    if isinstance(model, ModelParts):
        return list(model.parts)
    if isinstance(model, nn.Module):
        return [(MODEL_KEY, model)]
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
        return [(MODEL_KEY, m) for m in model]
    return None


class _ChainedState(MutableMapping[Any, Any]):
    """``OptimizerChain.state``: parameter -> its state, in the optimizer that updates it."""

    def __init__(self, optimizers: tuple[OptimizerLike, ...]) -> None:
        self.optimizers = optimizers
        self.owner: dict[int, OptimizerLike] = {}
        for i, o in enumerate(optimizers):
            for g in o.param_groups:
                for p in g["params"]:
                    if self.owner.setdefault(id(p), o) is not o:
                        raise FrameworkError(
                            f"a parameter (shape {tuple(p.shape)}) is in two of the state's optimizers "
                            f"(the second is number {i}); each parameter must be updated by one optimizer"
                        )

    def _of(self, p: Any) -> OptimizerLike:
        o = self.owner.get(id(p))
        if o is None:
            raise KeyError(p)
        return o

    def __getitem__(self, p: Any) -> Any:
        return self._of(p).state[p]

    def __setitem__(self, p: Any, value: Any) -> None:
        self._of(p).state[p] = value

    def __delitem__(self, p: Any) -> None:
        del self._of(p).state[p]

    def __iter__(self) -> Iterator[Any]:
        for o in self.optimizers:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self.optimizers)


class OptimizerChain:
    """Several optimizers as one optimizer-like view (see the module docstring). ``defaults`` is
    the optimizers' when they are all of one class (a strict load then checks the class), else
    None. No ``register_step_pre_hook``: an async save copies their state before it returns."""

    def __init__(self, optimizers: tuple[OptimizerLike, ...]) -> None:
        self.optimizers = optimizers
        self._state = _ChainedState(optimizers)
        classes = {type(o) for o in optimizers}
        self.defaults = getattr(optimizers[0], "defaults", None) if len(classes) == 1 else None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> MutableMapping[Any, Any]:
        return self._state


def _inner_optimizers(obj: object) -> tuple[str, list[Any]] | None:
    for name in _INNER:
        inner = getattr(obj, name, None)
        if isinstance(inner, (list, tuple)) and inner and all(is_optimizer_like(o) for o in inner):
            return name, list(inner)
    return None


def _state_empty(obj: object) -> bool:
    st = getattr(obj, "state", None)
    return not isinstance(st, MutableMapping) or len(st) == 0


def _hidden_inner(obj: object) -> str | None:
    """The attribute of ``obj`` holding an optimizer whose ``state`` is not ``obj``'s (rule 3)."""
    own = getattr(obj, "state", None)
    for name, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
        if value is obj or not is_optimizer_like(value):
            continue
        if getattr(value, "state", None) is not own:
            return name
    return None


def unwrap_optimizer(obj: object, where: str) -> list[Any]:
    """The optimizers ``obj`` stands for (the module docstring's rule); ``where`` names it in errors."""
    inner = _inner_optimizers(obj)
    if inner is not None and _state_empty(obj):
        name, optimizers = inner
        return [o for i, x in enumerate(optimizers) for o in unwrap_optimizer(x, f"{where}.{name}[{i}]")]
    if is_optimizer_like(obj) and _state_empty(obj):
        has_params = any(isinstance(p, torch.Tensor) for g in obj.param_groups for p in g["params"])  # type: ignore[attr-defined]
        hidden = _hidden_inner(obj) if has_params else None
        if hidden is not None:
            raise FrameworkError(
                f"{where} ({type(obj).__name__}) has parameters but no state of its own and wraps another "
                f"optimizer in .{hidden}: saving it would record no optimizer state. Pass the inner optimizer(s) "
                "(a list), or make the wrapper delegate .state and .param_groups to them"
            )
    return [obj]
