"""``framework="tensors"``: a flat mapping of checkpoint keys to whole tensors, held by one
process (``unickpt.FlatTensors``). Tools use it to write and read checkpoints that come from
elsewhere (``unickpt convert``: Hugging Face, PyTorch DCP, ByteCheckpoint): the keys are the
checkpoint's own (``model.<fqn>``, ``optimizer.state.<fqn>.<name>`` ...), every tensor is its
full box, and a load fills the given tensors in place. Plain tensors only: in a multi-rank job
each rank passes the same full tensors and unickpt writes each once (replicas)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

from ..errors import FrameworkError
from .base import SaveView, StateDescription
from .module_state import tensor_piece
from .plain import PlainTensor, flat_plain_tensors
from .views import DescribedAdapter

__all__ = ["FlatTensors", "FlatTensorsAdapter"]


class FlatTensors(MutableMapping[str, torch.Tensor]):
    """Checkpoint key -> full tensor; pass it as ``state["model"]`` with ``framework="tensors"``
    (or "auto")."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor] | None = None, objects: Mapping[str, Any] | None = None
    ) -> None:
        """``objects``: JSON objects saved with the tensors (e.g. a checkpoint's ``optimizer``
        param groups, carried over by ``unickpt modify``)."""
        self.objects: dict[str, Any] = dict(objects or {})
        self._d: dict[str, torch.Tensor] = {}
        for k, v in (tensors or {}).items():
            self[k] = v

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._d[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if not isinstance(key, str) or not key or "/" in key:
            raise FrameworkError(f"FlatTensors keys are non-empty strings without '/', got {key!r}")
        if not isinstance(value, torch.Tensor):
            raise FrameworkError(f"FlatTensors[{key!r}] must be a tensor, got {type(value).__name__}")
        self._d[key] = value

    def __delitem__(self, key: str) -> None:
        del self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


class FlatTensorsAdapter(DescribedAdapter):
    name = "tensors"

    def matches(self, state: Mapping[str, Any]) -> bool:
        return isinstance(state.get("model"), FlatTensors)

    def describe(self, state: Mapping[str, Any]) -> StateDescription | None:
        flat = state.get("model")
        if flat is None:
            return None
        if not isinstance(flat, FlatTensors):
            raise FrameworkError(
                f'framework="tensors" needs state["model"] to be a FlatTensors, got {type(flat).__name__}'
            )
        if state.get("optimizer") is not None:
            raise FrameworkError('framework="tensors" holds optimizer tensors under their keys; pass no "optimizer"')
        return StateDescription(tuple(tensor_piece(k, t, 0 if _distributed() else None) for k, t in flat.items()))

    def plain_tensors(self, state: Mapping[str, Any]) -> dict[str, PlainTensor]:
        """Every entry of the ``FlatTensors`` (``frameworks.plain``); none for another model."""
        flat = state.get("model")
        return flat_plain_tensors(flat) if isinstance(flat, FlatTensors) else {}

    def save_view(self, state: Mapping[str, Any]) -> SaveView:
        view = super().save_view(state)
        flat = state.get("model")
        if isinstance(flat, FlatTensors):
            view.objects.update(flat.objects)
        return view


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
