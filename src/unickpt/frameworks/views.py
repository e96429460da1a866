"""Save and load views, both derived from one ``StateDescription`` (the only translation path).

``DescribedAdapter`` gives every adapter ``save_view`` and ``load_view`` from its ``describe``:
  save_view: HELD and SHARED pieces become ``SaveItem``s (ELSEWHERE: another rank saves it);
             optimizer state tensors are described by their ``ParamState.pieces``; param groups
             and non-tensor state go into the ``optimizer`` object (``module_state``).
  load_view: the same pieces become destinations (``targets.LoadTargets``); optimizer state is
             materialised from the checkpoint's records by ``optim_state.OptimizerLoad`` on the
             same description; ``validate`` = the optimizer's checks, then shared values agree;
             ``apply`` = shared values copied, then the optimizer's state installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..format.records import Metadata
from ..planning.specs import SaveItem
from .base import OPTIM_PREFIX, LoadView, Role, SaveView, StateDescription
from .module_state import optimizer_save, refuse_meta
from .optim_state import OptimizerLoad, read_saved
from .targets import LoadTargets

if TYPE_CHECKING:
    from .plain import PlainTensor

__all__ = ["DescribedAdapter", "save_view", "load_view"]


def save_view(desc: StateDescription | None) -> SaveView:
    """What one rank saves of ``desc`` (None: nothing)."""
    view = SaveView(items=[])
    if desc is None:
        return view
    view.mesh = desc.mesh
    view.items = [SaveItem(pc.spec, pc.tensor) for pc in desc.model if pc.role is not Role.ELSEWHERE]
    refuse_meta(view.items, saving=True)
    if desc.optimizer is not None:
        items, objects = optimizer_save(desc.optimizer)
        view.items.extend(items)
        view.objects.update(objects)
    return view


def load_view(desc: StateDescription | None, md: Metadata | None = None, strict: bool = True) -> LoadView:
    """Destinations for ``desc`` from checkpoint ``md`` (None: the live tensors only); nothing
    in the job changes before ``apply``."""
    if desc is None:
        return LoadView(items=[], prefixes=())
    targets = LoadTargets()
    targets.add(desc.model, fresh=False)
    refuse_meta(targets.items, saving=False)
    if desc.optimizer is None:
        return LoadView(
            items=targets.items,
            prefixes=desc.prefixes,
            probes=targets.probes,
            validate=lambda: _checked(targets, ([], [])),
            apply=targets.apply_shared,
        )
    optim = OptimizerLoad(desc.optimizer, read_saved(md), strict, targets)

    def apply() -> None:
        targets.apply_shared()
        optim.apply()

    return LoadView(
        items=targets.items,
        prefixes=(*desc.prefixes, OPTIM_PREFIX),
        probes=targets.probes,
        validate=lambda: _checked(targets, optim.validate()),
        apply=apply,
    )


def _checked(targets: LoadTargets, keys: tuple[list[str], list[str]]) -> tuple[list[str], list[str]]:
    targets.check_shared()
    return keys


class DescribedAdapter:
    """Base class of adapters: ``save_view`` and ``load_view`` from ``describe``. Subclasses set
    ``name`` and implement ``matches`` and ``describe`` (see ``base.FrameworkAdapter``)."""

    name: str = ""

    def matches(self, state: Mapping[str, Any]) -> bool:
        raise NotImplementedError

    def describe(self, state: Mapping[str, Any]) -> StateDescription | None:
        raise NotImplementedError

    def save_view(self, state: Mapping[str, Any]) -> SaveView:
        return save_view(self.describe(state))

    def load_view(self, state: Mapping[str, Any], md: Metadata | None = None, strict: bool = True) -> LoadView:
        return load_view(self.describe(state), md, strict)

    def plain_tensors(self, state: Mapping[str, Any]) -> dict[str, PlainTensor]:
        """None by default: sharded tensors (FSDP1, Megatron) keep their ShapeMismatchError."""
        return {}
