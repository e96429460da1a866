"""The save engine: runs one save on one rank, as a sequence of stages.

Call order (every rank; stages marked * are collectives on the checkpoint group):
  ``plan``*   gather local plans -> rank 0 dedups, balances and lays out bytes -> scatter;
  ``stage``   snapshot: bind the bytes to write (live tensors for a blocking save, staging copies
              for an async one, see ``engine.staging``);
  ``write``   parallel writes of this rank's data files with per-entry CRC32C, fsync;
  ``commit``* gather checksums -> rank 0 builds the metadata, publishes it atomically (the
              commit), removes the previous checkpoint's data -> everyone learns the outcome.
A failure on any rank surfaces on every rank as the same ``RankFailures`` (``run_stage``).
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import crc32c

from ..coordination.base import Coordinator, run_stage
from ..errors import CheckpointError
from ..format.codec import encode_metadata
from ..format.records import (
    DATA_DIR,
    FORMAT_VERSION,
    METADATA_FILE,
    BlobRecord,
    JSONValue,
    Metadata,
    ShardRecord,
    TensorRecord,
    Topology,
)
from ..planning.save_plan import GlobalSavePlan, LocalSavePlan, RankSavePlan, plan_save
from ..storage.base import Buffer, Storage

__all__ = ["SaveRequest", "plan_stage", "write_stage", "commit_stage", "new_save_id"]


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """What one rank asks to save; the same on every call while the sharding is unchanged."""

    framework: str
    role: str | None
    mesh: tuple[tuple[str, int], ...]
    files_per_rank: int


def new_save_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:12]


def plan_stage(coord: Coordinator, local: LocalSavePlan, files_per_rank: int,
               cached: tuple[LocalSavePlan, GlobalSavePlan] | None = None,
               ) -> tuple[RankSavePlan, GlobalSavePlan | None]:
    """Collective: return this rank's plan (and the global plan on rank 0).

    With ``cached`` (the previous local plan and global plan) the ranks only agree that nothing
    changed, and reuse the layout under a fresh save id; otherwise plans are gathered again."""
    unchanged = cached is not None and cached[0] == local
    if coord.world_size > 1:
        unchanged = all(coord.all_gather_object(unchanged))
    save_id = coord.broadcast_object(new_save_id() if coord.rank == 0 else None)
    if unchanged:
        assert cached is not None
        gplan = _rename_plan(cached[1], save_id)
        return gplan.rank_plans[coord.rank], gplan
    plans = coord.gather_object(local)
    if coord.rank == 0:
        assert plans is not None
        try:
            gplan: GlobalSavePlan | None = plan_save(plans, save_id, files_per_rank)
            payload: list[object] = list(gplan.rank_plans)
        except CheckpointError as e:
            gplan, payload = None, [e] * coord.world_size
    else:
        gplan, payload = None, None  # type: ignore[assignment]
    mine = coord.scatter_object(payload)
    if isinstance(mine, CheckpointError):
        raise mine
    # every rank keeps the global plan so the next save can reuse it without gathering
    gplan = coord.broadcast_object(gplan) if coord.world_size > 1 else gplan
    return mine, gplan


def _rename_plan(gplan: GlobalSavePlan, save_id: str) -> GlobalSavePlan:
    old = gplan.save_id
    rank_plans = tuple(
        RankSavePlan(rp.rank, save_id, tuple(
            type(e)(e.item_index, e.file.replace(old, save_id, 1), e.byte_offset, e.byte_length, e.blob_key)
            for e in rp.entries))
        for rp in gplan.rank_plans
    )
    return GlobalSavePlan(save_id, rank_plans, tuple(f.replace(old, save_id, 1) for f in gplan.files),
                          gplan.tensors, gplan.writers)


def write_stage(storage: Storage, plan: RankSavePlan, item_bytes: Sequence[Buffer],
                blobs: dict[str, bytes], threads: int) -> list[int]:
    """Write this rank's files in parallel; return the CRC32C of every entry (plan order)."""
    by_file: dict[str, list[int]] = {}
    for i, e in enumerate(plan.entries):
        by_file.setdefault(e.file, []).append(i)
    crcs = [0] * len(plan.entries)

    def write_file(name: str) -> None:
        parts = []
        for i in by_file[name]:
            e = plan.entries[i]
            data = blobs[e.blob_key] if e.blob_key else item_bytes[e.item_index]
            if len(data) != e.byte_length:
                raise CheckpointError(f"{name}: entry {i} has {len(data)} bytes, plan says {e.byte_length}")
            crcs[i] = crc32c.crc32c(data)
            parts.append(data)
        storage.write(name, parts)

    if len(by_file) <= 1 or threads <= 1:
        for name in by_file:
            write_file(name)
    else:
        with ThreadPoolExecutor(min(threads, len(by_file)), thread_name_prefix="unickpt-write") as pool:
            for f in [pool.submit(write_file, n) for n in by_file]:
                f.result()
    return crcs


def build_metadata(gplan: GlobalSavePlan, crcs_by_rank: list[list[int]], request: SaveRequest,
                   world_size: int, objects: dict[str, JSONValue]) -> Metadata:
    file_index = {f: i for i, f in enumerate(gplan.files)}
    located: dict[tuple[int, int], tuple[int, int, int, int]] = {}
    blobs: dict[str, BlobRecord] = {}
    for rp, crcs in zip(gplan.rank_plans, crcs_by_rank):
        for e, crc in zip(rp.entries, crcs):
            if e.blob_key:
                blobs[e.blob_key] = BlobRecord(e.blob_key, file_index[e.file], e.byte_offset, e.byte_length, crc)
            else:
                located[(rp.rank, e.item_index)] = (file_index[e.file], e.byte_offset, e.byte_length, crc)
    shards: dict[str, list[ShardRecord]] = {fqn: [] for fqn in gplan.tensors}
    for fqn, offs, lens, rank, idx in gplan.writers:
        fidx, boff, blen, crc = located[(rank, idx)]
        shards[fqn].append(ShardRecord(offs, lens, fidx, boff, blen, crc))
    tensors = {
        fqn: TensorRecord(fqn, dtype, shape, tuple(sorted(shards[fqn], key=lambda s: s.offsets)))
        for fqn, (dtype, shape) in gplan.tensors.items()
    }
    return Metadata(
        format_version=FORMAT_VERSION,
        save_id=gplan.save_id,
        created_unix=time.time(),
        topology=Topology(request.framework, world_size, request.mesh),
        files=gplan.files,
        tensors=tensors,
        objects=objects,
        blobs=blobs,
        role=request.role,
    )


def commit_stage(coord: Coordinator, storage: Storage, gplan: GlobalSavePlan | None,
                 crcs: list[int] | None, error: BaseException | None, request: SaveRequest,
                 objects: dict[str, JSONValue], cleanup_previous: bool) -> Metadata | None:
    """Collective: agree that every rank wrote, then rank 0 commits. Returns the metadata on rank 0."""

    def local() -> list[int]:
        if error is not None:
            raise error
        assert crcs is not None
        return crcs

    run_stage(coord, "save (write)", local)
    all_crcs = coord.gather_object(crcs)

    def finalize() -> Metadata | None:
        if coord.rank != 0:
            return None
        assert gplan is not None and all_crcs is not None
        md = build_metadata(gplan, all_crcs, request, coord.world_size, objects)
        sync_dir = getattr(storage, "sync_dir", None)
        if sync_dir is not None:
            for d in dict.fromkeys(f.rsplit("/", 1)[0] for f in gplan.files):
                sync_dir(d)
            sync_dir(DATA_DIR)
        storage.commit(METADATA_FILE, encode_metadata(md))
        if cleanup_previous:
            remove_stale_data(storage, keep_save_id=md.save_id)
        return md

    return run_stage(coord, "save (commit)", finalize)


def remove_stale_data(storage: Storage, keep_save_id: str) -> None:
    """Delete data of earlier or interrupted saves at this path (after a successful commit)."""
    keep = f"{DATA_DIR}/{keep_save_id}/"
    stale = [n for n in storage.list(DATA_DIR + "/") if not n.startswith(keep)]
    stale += [n for n in storage.list(METADATA_FILE + ".tmp-")]
    if stale:
        storage.delete(stale)
