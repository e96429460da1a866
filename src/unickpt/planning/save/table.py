"""One rank's shard specs as columns: the save planner's working form of a ``LocalSavePlan``.

A rank of a job with many small tensors describes ~10^4 shards; the coordinator plans every
rank's. As ``ShardSpec`` records that is one validated Python object per shard and rank (built
again when the coordinator decodes the gathered plans); as a ``ShardTable`` it is a few numpy
arrays, built once (``ShardTable.of`` from the specs, ``wire.decode_local_table`` from the
bytes a rank sent), checked as a whole (``box_problem``) and planned with vectorised steps
(``plan.plan_save``). Boxes of different ranks (0-d steps, 1-d biases, 2-d weights) share
one (n, D) layout: dimensions past a spec's ``ndim`` are padded as a full extent of 1 (offset 0,
length 1, shape 1), so element counts and box equality are unchanged.

Built by ``wire.encode_local_plan`` (every rank, the plan it sends) and ``plan.plan_save`` (rank
0, for plans given as records) with ``of``; ``wire.decode_local_table`` builds them from received
bytes; ``to_plan`` gives the records back (the tests' oracle, ``tests/support/save_oracle.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..specs import BlobSpec, ShardSpec
from .model import LocalSavePlan

__all__ = ["ShardTable"]


@dataclass(frozen=True, eq=False)
class ShardTable:
    """The shards of rank ``rank``: row ``i`` is its ``i``-th spec. ``name``/``dtype`` index
    ``names``/``dtypes``; ``source`` is the replica source (-1: none); ``shape``, ``offsets``
    and ``lengths`` are (n, D) int64 arrays padded past each row's ``ndim`` (see the module
    docstring). Arrays are not to be modified."""

    rank: int
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    name: np.ndarray
    dtype: np.ndarray
    ndim: np.ndarray
    source: np.ndarray
    shape: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    blobs: tuple[BlobSpec, ...] = ()

    def __len__(self) -> int:
        return len(self.name)

    @classmethod
    def of(cls, plan: LocalSavePlan) -> ShardTable:
        """The table of ``plan``'s specs (names and dtypes indexed in first-seen order)."""
        names: dict[str, int] = {}
        dtypes: dict[str, int] = {}
        shards = plan.shards
        n = len(shards)
        name = np.array([names.setdefault(s.fqn, len(names)) for s in shards], dtype=np.int64)
        dtype = np.array([dtypes.setdefault(s.dtype, len(dtypes)) for s in shards], dtype=np.int64)
        ndims = [len(s.global_shape) for s in shards]
        ndim = np.array(ndims, dtype=np.int64)
        source = np.array([-1 if s.replica_source is None else s.replica_source for s in shards], dtype=np.int64)
        width = max(ndims, default=0)
        shape = np.ones((n, width), dtype=np.int64)
        offsets = np.zeros((n, width), dtype=np.int64)
        lengths = np.ones((n, width), dtype=np.int64)
        for nd in set(ndims) - {0}:
            rows = np.flatnonzero(ndim == nd) if len(set(ndims)) > 1 else np.arange(n)
            picked = [shards[i] for i in rows.tolist()]
            for out, field in ((shape, "global_shape"), (offsets, "offsets"), (lengths, "lengths")):
                out[rows, :nd] = np.array([getattr(s, field) for s in picked], dtype=np.int64).reshape(len(rows), nd)
        return cls(
            plan.rank, tuple(names), tuple(dtypes), name, dtype, ndim, source, shape, offsets, lengths, plan.blobs
        )

    def box_problem(self) -> bool:
        """True if some row is not a valid spec: a name or dtype index outside its table, or a
        box outside its shape (what ``ShardSpec`` refuses). Checked for decoded tables."""
        if len(self.name) == 0:
            return False
        if self.name.min() < 0 or self.name.max() >= len(self.names):
            return True
        if self.dtype.min() < 0 or self.dtype.max() >= len(self.dtypes):
            return True
        if not set(map(type, self.names)) <= {str} or not set(map(type, self.dtypes)) <= {str}:
            return True
        return bool(
            (self.offsets < 0).any() or (self.lengths < 0).any() or (self.offsets + self.lengths > self.shape).any()
        )

    def spec(self, i: int) -> ShardSpec:
        """Row ``i`` as a record (checked: ``ShardSpec`` raises for an invalid box)."""
        nd = int(self.ndim[i])
        src = int(self.source[i])
        return ShardSpec(
            self.names[int(self.name[i])],
            self.dtypes[int(self.dtype[i])],
            tuple(int(v) for v in self.shape[i, :nd]),
            tuple(int(v) for v in self.offsets[i, :nd]),
            tuple(int(v) for v in self.lengths[i, :nd]),
            None if src < 0 else src,
        )

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """Every row's (global shape, offsets, lengths) as tuples of Python ints."""
        out = []
        ndims = self.ndim.tolist()
        for nd, shape, offs, lens in zip(ndims, self.shape.tolist(), self.offsets.tolist(), self.lengths.tolist()):
            out.append((tuple(shape[:nd]), tuple(offs[:nd]), tuple(lens[:nd])))
        return out

    def to_plan(self) -> LocalSavePlan:
        """The records of this table (specs built as ``ShardSpec.checked_box``: call it on a
        table whose ``box_problem`` is False)."""
        names, dtypes = self.names, self.dtypes
        specs = tuple(
            ShardSpec.checked_box(names[n], dtypes[d], shape, offs, lens, None if src < 0 else src)
            for n, d, src, (shape, offs, lens) in zip(
                self.name.tolist(), self.dtype.tolist(), self.source.tolist(), self.boxes()
            )
        )
        return LocalSavePlan(self.rank, specs, self.blobs)
