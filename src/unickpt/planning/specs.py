"""The framework-neutral shard spec that adapters produce and planners consume.

An adapter describes every local piece of state as ``ShardSpec`` (which box of which global
tensor) plus the live tensor holding it (``SaveItem`` on save, ``LoadItem`` on load: the
destination written in place). Specs are frozen records; items hold tensors and so are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .boxes import numel

if TYPE_CHECKING:  # the tensors are only annotated: the specs themselves import without torch
    import torch

__all__ = ["Shape", "ShardSpec", "SaveItem", "LoadItem", "BlobSpec"]

Shape = tuple[int, ...]

_new = object.__new__  # ShardSpec.checked_box: a frozen record, built directly


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Box ``(offsets, lengths)`` of global tensor ``fqn`` (dtype name, global shape).

    ``replica_source``: when several ranks hold this box (replicas), the rank whose copy is
    saved: the replica the framework treats as authoritative (DDP broadcasts buffers from rank 0
    of its group). None: any replica (the planner balances bytes, worst-fit)."""

    fqn: str
    dtype: str
    global_shape: Shape
    offsets: Shape
    lengths: Shape
    replica_source: int | None = None

    def __post_init__(self) -> None:
        nd = len(self.global_shape)
        if len(self.offsets) != nd or len(self.lengths) != nd:
            raise ValueError(f"{self.fqn}: box rank differs from tensor rank {nd}")
        for o, n, g in zip(self.offsets, self.lengths, self.global_shape):
            if o < 0 or n < 0 or o + n > g:
                raise ValueError(
                    f"{self.fqn}: box offsets={self.offsets} lengths={self.lengths} outside {self.global_shape}"
                )

    @classmethod
    def checked_box(
        cls,
        fqn: str,
        dtype: str,
        global_shape: Shape,
        offsets: Shape,
        lengths: Shape,
        replica_source: int | None = None,
    ) -> ShardSpec:
        """A spec whose box ``(global_shape, offsets, lengths)`` a spec passed ``__post_init__``
        with before (the describe stage's memo of DTensor boxes, a decoded plan whose rows were
        checked as a whole): the same record, without checking the box again."""
        spec = _new(cls)
        _FIELDS[0](spec, fqn)
        _FIELDS[1](spec, dtype)
        _FIELDS[2](spec, global_shape)
        _FIELDS[3](spec, offsets)
        _FIELDS[4](spec, lengths)
        _FIELDS[5](spec, replica_source)
        return spec

    @property
    def numel(self) -> int:
        return numel(self.lengths)

    @property
    def box(self) -> tuple[Shape, Shape]:
        return (self.offsets, self.lengths)


# the slots' setters, in field order (ShardSpec.checked_box writes them as __init__ would)
_FIELDS = tuple(
    ShardSpec.__dict__[f].__set__ for f in ("fqn", "dtype", "global_shape", "offsets", "lengths", "replica_source")
)


@dataclass(frozen=True, slots=True)
class BlobSpec:
    """An opaque per-rank byte blob (extra state, dataloader part) to store with the tensors."""

    key: str
    nbytes: int


@dataclass(slots=True)
class SaveItem:
    """A local tensor holding exactly the box ``spec`` (shape == spec.lengths; any strides)."""

    spec: ShardSpec
    tensor: torch.Tensor


@dataclass(slots=True)
class LoadItem:
    """A writable destination for box ``spec`` (shape == spec.lengths), filled in place.

    ``fresh``: the tensor was allocated by this load (optimizer state the live optimizer does not
    have yet) and joins the live state only when the load is applied, so reading into it can
    never leave the job half-changed; otherwise it is (a view of) a live tensor."""

    spec: ShardSpec
    tensor: torch.Tensor
    fresh: bool = False
