"""Load destinations from described pieces (``views.load_view`` and ``optim_state.OptimizerLoad``).

``LoadTargets.add(pieces, fresh)`` turns each :class:`~unickpt.frameworks.base.Piece` into what
the engine fills: a HELD piece is its own destination (live, or fresh: allocated by this load);
a SHARED group (one 0-d tensor behind several keys) becomes scratch probes, read before
``validate``; an ELSEWHERE piece a scratch tensor read and dropped. ``check_shared`` (from
``validate``) requires each group's probes to agree; ``apply_shared`` (from ``apply``) copies
the agreed value into the tensor behind them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import FrameworkError
from ..planning.specs import LoadItem
from .base import Piece, Role

__all__ = ["LoadTargets"]


class LoadTargets:
    """The destinations of one load: ``items`` (filled by the engine) and ``probes`` (read
    first, into scratch)."""

    def __init__(self) -> None:
        self.items: list[LoadItem] = []
        self.probes: list[LoadItem] = []
        self._shared: list[tuple[torch.Tensor, list[LoadItem]]] = []

    def add(self, pieces: Iterable[Piece], fresh: bool) -> None:
        """Destinations for ``pieces``; ``fresh``: their tensors were allocated by this load."""
        if isinstance(pieces, list) and len(pieces) == 1 and pieces[0].role is Role.HELD:  # the common case
            self.items.append(LoadItem(pieces[0].spec, pieces[0].tensor, fresh))
            return
        groups: dict[int, tuple[torch.Tensor, list[LoadItem]]] = {}
        for pc in pieces:
            if pc.role is Role.HELD:
                self.items.append(LoadItem(pc.spec, pc.tensor, fresh))
            elif pc.role is Role.ELSEWHERE:
                self.items.append(LoadItem(pc.spec, pc.tensor.new_empty(()), True))
            else:
                probe = LoadItem(pc.spec, torch.empty((), dtype=pc.tensor.dtype), True)
                groups.setdefault(id(pc.tensor), (pc.tensor, []))[1].append(probe)
                self.probes.append(probe)
        self._shared.extend(groups.values())

    def check_shared(self) -> None:
        """Every SHARED group's probes hold one value (after the probes were read)."""
        for _, probes in self._shared:
            first = probes[0]
            for other in probes[1:]:
                if not torch.equal(other.tensor, first.tensor):
                    raise FrameworkError(
                        f"{other.spec.fqn} = {other.tensor.item()} but {first.spec.fqn} = {first.tensor.item()}: "
                        "an FSDP1 flat parameter keeps one value for all its original parameters; use "
                        "use_orig_params=True to load per-parameter values"
                    )

    def apply_shared(self) -> None:
        """Copy each SHARED group's value into the tensor behind it."""
        with torch.no_grad():
            for target, probes in self._shared:
                target.copy_(probes[0].tensor)
