"""The metadata of a save, built from its global plan and what every rank wrote (pure: no I/O).

Runs in rank 0's commit (``engine.save.commit``) once every rank reported its data files' sizes
and chunk checksums; the result is encoded (``format.codec``) and published. ``build_metadata``
locates every kept shard and blob by the plan (tensors split alike over every rank's files become
one ``SplitLayout``), takes the checksums in the plan's file order and the dataloader section from
the saved blobs (``state.loader``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import PlanningError
from ..state.loader import LOADER_SECTION, loader_index
from .checksums import DEFAULT_CHUNK, ChunkChecksums
from .dtypes import itemsize
from .layouts import SplitLayout, SplitShards
from .records import (
    OLDEST_FORMAT_VERSION,
    BlobRecord,
    JSONValue,
    Metadata,
    ShardRecord,
    TensorRecord,
    Topology,
    data_path,
)

__all__ = ["SaveSource", "FileSums", "RankSums", "PlannedSave", "build_metadata"]

Shape = tuple[int, ...]

FileSums = dict[str, tuple[int, list[int]]]  # data file name -> (size, chunk checksums)


class PlannedSave(Protocol):
    """What ``build_metadata`` reads of a save's global plan (``planning.save.model.GlobalSavePlan``
    is one; format does not import planning)."""

    @property
    def save_id(self) -> str: ...
    @property
    def files(self) -> tuple[str, ...]: ...
    @property
    def tensors(self) -> Mapping[str, tuple[str, Shape]]: ...
    @property
    def writers(self) -> Sequence[tuple[str, Shape, Shape, int, int]]: ...
    @property
    def layouts(self) -> Sequence[tuple[tuple[int, ...], tuple[tuple[str, int], ...]]]: ...
    def explicit_entries(self) -> Iterator[tuple[int, Any]]: ...


@dataclass(frozen=True, slots=True)
class SaveSource:
    """Who saves (recorded in the metadata as information: framework, role, mesh)."""

    framework: str
    role: str | None
    mesh: tuple[tuple[str, int], ...]


def build_metadata(
    gplan: PlannedSave,
    sums_by_rank: list[RankSums],
    source: SaveSource,
    world_size: int,
    objects: dict[str, JSONValue],
) -> Metadata:
    """The metadata of a save (rank 0, at the commit): every kept shard and blob located by the
    global plan, the data files' sizes and chunk checksums from every rank's write stage
    (``sums_by_rank``: each rank's ``(chunk_size, {file: (size, chunk crcs)})``)."""
    file_index = {f: i for i, f in enumerate(gplan.files)}
    located: dict[tuple[int, int], tuple[int, int, int]] = {}
    blobs: dict[str, BlobRecord] = {}
    for rank, e in gplan.explicit_entries():  # the entries the layouts below do not describe
        if e.blob_key:
            if e.blob_key in blobs:  # two ranks saved one key (e.g. one loader part twice)
                raise PlanningError(f"blob {e.blob_key!r} was saved by two ranks (rank {rank} is the second)")
            blobs[e.blob_key] = BlobRecord(e.blob_key, file_index[e.file], e.byte_offset, e.byte_length)
        else:
            located[(rank, e.item_index)] = (file_index[e.file], e.byte_offset, e.byte_length)
    tensors: dict[str, TensorRecord] = {}
    for files, entries in gplan.layouts:  # tensors split alike over every rank's files: described once
        rows = []
        for fqn, d in entries:
            dtype, shape = gplan.tensors[fqn]
            rows.append((fqn, itemsize(dtype), shape, d))
        lay = SplitLayout(files, tuple(rows))
        for pos, (fqn, _, shape, _) in enumerate(rows):
            tensors[fqn] = TensorRecord(fqn, gplan.tensors[fqn][0], shape, SplitShards(lay, pos))
    shards: dict[str, list[ShardRecord]] = {fqn: [] for fqn in gplan.tensors if fqn not in tensors}
    for fqn, offs, lens, rank, idx in gplan.writers:
        if fqn in tensors:
            continue
        fidx, boff, blen = located[(rank, idx)]
        shards[fqn].append(ShardRecord(offs, lens, fidx, boff, blen))
    for fqn, found in shards.items():
        dtype, shape = gplan.tensors[fqn]
        tensors[fqn] = TensorRecord(fqn, dtype, shape, tuple(sorted(found, key=lambda s: s.offsets)))
    tensors = {fqn: tensors[fqn] for fqn in gplan.tensors}  # the plan's tensor order
    index = loader_index(blobs)
    return Metadata(
        format_version=OLDEST_FORMAT_VERSION,
        save_id=gplan.save_id,
        created_unix=time.time(),
        topology=Topology(source.framework, world_size, source.mesh),
        files=tuple(data_path(gplan.save_id, f) for f in gplan.files),
        tensors=tensors,
        objects=objects,
        blobs=blobs,
        role=source.role,
        sections={} if index is None else {LOADER_SECTION: index},
        checksums=_checksums(gplan, sums_by_rank),
    )


RankSums = tuple[int, FileSums]  # one rank's checksum chunk size and its files' (size, chunk crcs)


def _checksums(gplan: PlannedSave, sums_by_rank: list[RankSums]) -> ChunkChecksums:
    """Every data file's size and chunk checksums, in the order of ``gplan.files``."""
    chunks = {c for c, _ in sums_by_rank}
    if len(chunks) > 1:
        raise PlanningError(
            f"ranks checksum their files in chunks of different sizes {sorted(chunks)} "
            "(each writes with the chunk its part of the save plan names)"
        )
    found: FileSums = {}
    for rank, (_, files) in enumerate(sums_by_rank):
        for name, got in files.items():
            if name in found:
                path = data_path(gplan.save_id, name)
                raise PlanningError(f"data file {path} was written by two ranks (rank {rank} is the second)")
            found[name] = got
    missing = [data_path(gplan.save_id, f) for f in gplan.files if f not in found]
    if missing:
        raise PlanningError(f"no checksums were reported for data file(s) {missing[:5]}")
    return ChunkChecksums.from_files(chunks.pop() if chunks else DEFAULT_CHUNK, [found[f] for f in gplan.files])
