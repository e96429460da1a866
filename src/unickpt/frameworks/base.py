"""The framework adapter protocol: what an adapter describes, what unickpt derives from it.

An adapter translates live objects (``state["model"]``, ``state["optimizer"]``) to unickpt's
neutral shard specs; it performs no I/O and no collectives. It describes the state ONCE
(:class:`StateDescription`): every model tensor piece (checkpoint key, box, local view, replica
source) and, per live optimizer parameter, how its state is laid out (:class:`ParamState`: its
original parameters, their shapes, the pieces of a state tensor, the layout a missing state
tensor gets). Save and load are both derived from that one description (``frameworks.views``),
so they cannot drift apart.

Order of use, on every rank (by the save and load pipelines, ``engine.save.pipeline`` /
``engine.load.pipeline``):
  choose:  ``FrameworkRegistry.resolve(framework, state)`` (``framework="auto"``: the
           highest-priority adapter whose ``matches(state)`` is true; see ``registry``).
  save:    ``adapter.save_view(state)`` = ``views.save_view(adapter.describe(state))`` -> SaveView:
           items (spec + local tensor) and JSON objects (the ``optimizer`` param groups and
           non-tensor state values) -> planned, staged, written.
  load:    ``adapter.load_view(state, md, strict)`` = ``views.load_view(adapter.describe(state),
           md, strict)`` -> LoadView; nothing in the job changed yet. Destinations are the
           described live views, or fresh tensors for optimizer state the live optimizer lacks
           (laid out by ``ParamState.like``) -> ``probes`` read (values several keys share in
           one tensor, e.g. an FSDP1 flat parameter's ``step``) -> ``view.validate()``
           (param groups, hyper-parameter types, shared values agree) -> every rank agrees ->
           the engine fills ``items`` -> ``view.apply()`` installs the optimizer state (state
           the checkpoint does not have is dropped) and param groups. A refused load leaves
           the job as it was.
Adapters are registered by stable name (the name goes into checkpoints as information only).

Optimizers are duck-typed (:class:`OptimizerLike`); unickpt never requires a
``torch.optim.Optimizer``. The contract, exactly as unickpt uses it:
  * ``param_groups``: a list of dicts; each has ``"params"`` (a list of the live parameter
    tensors it updates) and hyper-parameters (JSON-like values or tensors). unickpt reads the
    groups and, at load, sets hyper-parameter keys in those same dicts (never replaces them).
  * ``state``: a mutable mapping from parameter to a dict of state (tensors and plain values),
    like ``torch.optim.Optimizer.state``: read with ``state.get(p)``; a load sets
    ``state[p] = {...}`` and removes ``state.pop(p, None)``.
  * optional ``defaults`` (a dict of the class's hyper-parameters): with it a strict load
    refuses a checkpoint saved from another optimizer class; without it that check is skipped.
  * optional ``register_step_pre_hook(hook)`` that runs ``hook(optimizer, args, kwargs)``
    before every ``step()``: with it an asynchronous save copies the parameters and optimizer
    state after ``save`` returns (``step()`` waits for the copy); without it they are copied
    inside ``save``.
unickpt never calls ``step()``, ``state_dict()`` or ``load_state_dict()``: wrappers that
delegate ``param_groups`` and ``state`` to an inner optimizer (LR-scheduled wrappers,
Megatron's ``FP32Optimizer`` / ``DistributedOptimizer``) are accepted as they are. The
generic adapters name parameters by the model's parameter names, so every tensor in
``param_groups`` must be a parameter of ``state["model"]``; an optimizer updating other tensors
(fp32 main copies) needs an adapter that maps them (``ParamState``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import FrameworkError
from ..format.records import JSONValue, Metadata
from ..planning.specs import LoadItem, SaveItem, Shape, ShardSpec

if TYPE_CHECKING:
    from .plain import PlainTensor

__all__ = [
    "MODEL_PREFIX",
    "OPTIM_PREFIX",
    "STATE_PREFIX",
    "Role",
    "Piece",
    "ParamState",
    "OptimizerLike",
    "OptimizerDescription",
    "StateDescription",
    "SaveView",
    "LoadView",
    "FrameworkAdapter",
    "is_optimizer_like",
    "supports_step_hooks",
]

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optimizer."
STATE_PREFIX = f"{OPTIM_PREFIX}state."  # + <param fqn>.<state name>


class Role(enum.Enum):
    """What a described piece is to save and to load."""

    HELD = "held"
    """This rank's box of a tensor: saved from the view, loaded into it in place."""
    SHARED = "shared"
    """A 0-d value that one live tensor holds for several keys (an FSDP1 flat parameter's
    ``step``, one key per original parameter): saved under each key; a load reads every key
    into a scratch probe, requires them to agree (``validate``) and copies the value at apply.
    The pieces of one value carry the same tensor object (that is what groups them)."""
    ELSEWHERE = "elsewhere"
    """A 0-d tensor that another rank holds (no empty box exists for it): nothing is saved; a
    load reads it into a scratch tensor and drops it. ``tensor`` gives only dtype and device."""


@dataclass(frozen=True, slots=True, eq=False)
class Piece:
    """One described piece of state: box ``spec`` of a checkpoint tensor and the local tensor
    holding it (shape == ``spec.lengths``; a view of live state, written in place at load)."""

    spec: ShardSpec
    tensor: torch.Tensor
    role: Role = Role.HELD


class ParamState(Protocol):
    """How one live optimizer parameter's state maps to checkpoint keys (an adapter gives one
    per parameter in ``param_groups``). Keys: ``optimizer.state.<fqn>.<state name>``."""

    @property
    def fqns(self) -> tuple[str, ...]:
        """The original parameters this live one stands for (several: an FSDP1 flat parameter,
        whose groups and non-tensor state are recorded per original parameter)."""

    @property
    def shapes(self) -> tuple[Shape, ...]:
        """The global shape of each of ``fqns``."""

    @property
    def holds(self) -> bool:
        """False when this rank holds no element of the parameter and its optimizer never has
        state for it (FSDP1 use_orig_params=True gives it no gradient): a load gives it none."""

    def like(self) -> tuple[torch.Tensor, bool]:
        """The tensor a missing parameter-shaped state tensor is laid out like (a DTensor with
        the parameter's mesh and placements, FSDP1's flat shard, a plain tensor), and whether
        it must start zeroed (FSDP1 flat state has padding that no checkpoint fills)."""

    def pieces(self, name: str, value: torch.Tensor) -> list[Piece]:
        """The pieces of state tensor ``name`` = ``value`` (live, or freshly allocated by a load)."""


class OptimizerLike(Protocol):
    """What unickpt uses of an optimizer (see the module docstring for the full contract)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> MutableMapping[Any, Any]: ...


def is_optimizer_like(obj: object) -> bool:
    """Whether ``obj`` fulfils the :class:`OptimizerLike` contract: ``param_groups`` a list of
    dicts that each have ``"params"``, and ``state`` a mutable mapping."""
    try:
        groups = getattr(obj, "param_groups", None)
        state = getattr(obj, "state", None)
    except Exception:  # a property of a half-built object: not usable as an optimizer
        return False
    return (
        isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        and isinstance(state, MutableMapping)
    )


def supports_step_hooks(obj: object) -> bool:
    """Whether an asynchronous save may defer copying ``obj``'s parameters and state: it is
    optimizer-like and has ``register_step_pre_hook`` (its ``step()`` then waits for the copy)."""
    return is_optimizer_like(obj) and callable(getattr(obj, "register_step_pre_hook", None))


@dataclass(frozen=True, eq=False)
class OptimizerDescription:
    """An optimizer and the layout of every parameter in its ``param_groups``.

    ``optimizer`` is what unickpt reads and, at load, changes; an adapter may pass a view of the
    user's object (e.g. one flat mapping over a chain of optimizers) as long as it is
    optimizer-like and changes reach the user's optimizer."""

    optimizer: OptimizerLike
    params: Mapping[int, ParamState]  # id(live parameter) -> its layout

    def __post_init__(self) -> None:
        for gi, g in enumerate(self.optimizer.param_groups):
            for p in g["params"]:
                if id(p) not in self.params:
                    raise FrameworkError(
                        f"optimizer param group {gi} holds a parameter (shape {tuple(p.shape)}) that the "
                        "framework adapter does not describe"
                    )

    def names(self) -> dict[int, tuple[str, ...]]:
        """id(live parameter) -> the fqns of the original parameters it stands for."""
        return {k: ps.fqns for k, ps in self.params.items()}


@dataclass(frozen=True, eq=False)
class StateDescription:
    """Everything one rank holds of ``state``, described once for save and load.

    ``model``: the pieces of live tensors filled in place (parameters and persistent buffers
    under ``model.``; an adapter may add other live tensors it owns, under ``optimizer.``).
    ``optimizer``: the optimizer and its parameters' layouts (None: no optimizer in ``state``).
    ``mesh``: the device mesh, recorded in the checkpoint as information.
    ``prefixes``: the checkpoint key prefixes of ``model`` (``model.``; ``<key>.`` for a module
    under another state key, ``frameworks.parts``): the keys a load of this view answers for."""

    model: tuple[Piece, ...]
    optimizer: OptimizerDescription | None = None
    mesh: tuple[tuple[str, int], ...] = ()
    prefixes: tuple[str, ...] = (MODEL_PREFIX,)


@dataclass
class SaveView:
    items: list[SaveItem]
    objects: dict[str, JSONValue] = field(default_factory=dict)
    mesh: tuple[tuple[str, int], ...] = ()


def _no_keys() -> tuple[list[str], list[str]]:
    return [], []


def _nothing() -> None:
    return None


@dataclass
class LoadView:
    items: list[LoadItem]
    # the checkpoint keys (tensor fqns / object keys) this view is responsible for
    prefixes: tuple[str, ...]
    # small scratch destinations read before ``validate`` (never live tensors)
    probes: list[LoadItem] = field(default_factory=list)
    # checks of the non-tensor state, no side effects: (missing keys, unexpected keys)
    validate: Callable[[], tuple[list[str], list[str]]] = _no_keys
    # after every rank validated and read: make the loaded state the live state
    apply: Callable[[], None] = _nothing


class FrameworkAdapter(Protocol):
    """A framework adapter. Implement ``name``, ``matches`` and ``describe``; subclass
    ``views.DescribedAdapter`` for ``save_view`` / ``load_view`` (derived from ``describe``)."""

    name: str

    def matches(self, state: Mapping[str, Any]) -> bool:
        """True if ``state`` holds this framework's objects (``framework="auto"``; cheap, no
        collective, never raises for another framework's objects)."""

    def describe(self, state: Mapping[str, Any]) -> StateDescription | None:
        """This rank's state, described once (None: ``state`` has no model); no I/O, no
        collective, nothing changed. Raises ``FrameworkError`` for objects it cannot describe."""

    def save_view(self, state: Mapping[str, Any]) -> SaveView:
        """What to save (``views.save_view`` of ``describe``)."""

    def load_view(self, state: Mapping[str, Any], md: Metadata | None = None, strict: bool = True) -> LoadView:
        """Destinations for checkpoint ``md`` (None: only the live tensors); no side effects."""

    def plain_tensors(self, state: Mapping[str, Any]) -> dict[str, PlainTensor]:
        """Checkpoint key -> each live tensor this adapter loads as it is (no shard of a larger
        one), which ``RestoreOptions(resize_plain_tensors=True)`` may replace by the saved shape
        (``frameworks.plain``; ``views.DescribedAdapter``: none)."""
