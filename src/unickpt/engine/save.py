"""The save engine: runs one save on one rank, as a sequence of stages.

Call order (every rank; stages marked * are collectives on the checkpoint group):
  ``plan``*   one all_gather: is every rank's cached plan still valid (+ rank 0's random save
              id); if not, gather local plans -> rank 0 dedups, balances and lays out bytes ->
              broadcast;
  ``stage``   snapshot: bind the bytes to write (live tensors for a blocking save, staging copies
              for an async one, see ``engine.staging``);
  ``write``   parallel writes of this rank's data files with per-entry CRC32C, fsync;
  ``commit``* gather checksums and every rank's JSON objects -> rank 0 merges the objects
              (``planning.objects``: optimizer param groups per parameter), builds the metadata,
              checks that every data file it names is on storage in full and that the save
              still holds its lock, publishes the metadata atomically (the commit), removes the
              data of unickpt's own older saves (``remove_stale_data``; a failure there is only a
              warning: the checkpoint is committed) -> everyone learns the outcome.
A failure on any rank surfaces on every rank as the same error (``run_stage``).
"""

from __future__ import annotations

import json
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import crc32c

from ..coordination.base import Coordinator, run_stage
from ..errors import CheckpointError, MissingDataFileError, TruncatedDataFileError
from ..format.codec import encode_metadata
from ..format.records import (
    DATA_DIR,
    METADATA_FILE,
    OLDEST_FORMAT_VERSION,
    BlobRecord,
    JSONValue,
    Metadata,
    ShardRecord,
    TensorRecord,
    Topology,
)
from ..monitoring.events import emit, phase
from ..planning.objects import merge_rank_objects
from ..planning.save_plan import GlobalSavePlan, LocalSavePlan, RankSavePlan, plan_save
from ..storage.base import Buffer, Storage
from .ownership import delete_save_data, is_save_id, mark_save, marked_save_ids, marker_name

__all__ = [
    "SaveRequest",
    "PlanKey",
    "CachedPlan",
    "PlanCache",
    "plan_stage",
    "write_stage",
    "commit_stage",
    "new_save_id",
]


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """Who saves (recorded in the metadata as information: framework, role, mesh)."""

    framework: str
    role: str | None
    mesh: tuple[tuple[str, int], ...]


def new_save_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:12]


@dataclass(frozen=True, slots=True)
class PlanKey:
    """What a cached plan was made for, beside the local plans themselves: the role, the adapter
    and every option that changes the layout of the files. Today that is only
    ``SaveOptions.files_per_rank`` (``io_threads``, ``cleanup_previous``, ``background_snapshot``
    and ``timeout`` do not change the plan); a new layout option must be added here."""

    role: str | None
    framework: str
    files_per_rank: int


@dataclass(frozen=True, slots=True)
class CachedPlan:
    """A global plan kept for reuse while this rank's local plan stays the same.

    Reuse renames the files under the save id rank 0 drew for this save (``<base>-<seq>-<token>``:
    the ``base`` shows which plan was reused, the random token makes every id unpredictable)."""

    local: LocalSavePlan
    plan: GlobalSavePlan
    base: str
    seq: int = 0

    def next(self, token: str) -> CachedPlan:
        seq = self.seq + 1
        return CachedPlan(self.local, _rename_plan(self.plan, f"{self.base}-{seq:06d}-{token}"), self.base, seq)


class PlanCache:
    """Global plans by ``PlanKey``, reused while every rank's local plan is unchanged. One per
    process (``api``); a later ``Checkpointer`` object can own one instead."""

    def __init__(self) -> None:
        self._plans: dict[PlanKey, CachedPlan] = {}

    def get(self, key: PlanKey) -> CachedPlan | None:
        return self._plans.get(key)

    def put(self, key: PlanKey, plan: CachedPlan) -> None:
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()


def plan_stage(
    coord: Coordinator, local: LocalSavePlan, files_per_rank: int, cached: CachedPlan | None = None
) -> CachedPlan:
    """Collective (foreground group): this save's global plan, from the cache when every rank's
    local plan is unchanged (one tiny all_gather, which also carries rank 0's fresh random save
    id), else gathered and computed by rank 0."""
    unchanged = cached is not None and cached.local == local
    save_id = new_save_id()
    if coord.world_size > 1:
        votes = coord.all_gather_object((unchanged, save_id if coord.rank == 0 else None))
        unchanged = all(v for v, _ in votes)
        save_id = votes[0][1]
    if unchanged:
        assert cached is not None
        return cached.next(save_id.rsplit("-", 1)[-1])
    plans = coord.gather_object(local)
    payload: object = None
    if coord.rank == 0:
        assert plans is not None
        try:
            payload = plan_save(plans, save_id, files_per_rank)
        except CheckpointError as e:
            payload = e
    # every rank keeps the global plan so later saves reuse it without gathering
    payload = coord.broadcast_object(payload) if coord.world_size > 1 else payload
    if isinstance(payload, CheckpointError):
        raise payload
    assert isinstance(payload, GlobalSavePlan)
    return CachedPlan(local, payload, save_id)


def _rename_plan(gplan: GlobalSavePlan, save_id: str) -> GlobalSavePlan:
    old = gplan.save_id
    rank_plans = tuple(
        RankSavePlan(rp.rank, save_id, tuple(replace(e, file=e.file.replace(old, save_id, 1)) for e in rp.entries))
        for rp in gplan.rank_plans
    )
    return replace(
        gplan, save_id=save_id, rank_plans=rank_plans, files=tuple(f.replace(old, save_id, 1) for f in gplan.files)
    )


def write_stage(
    storage: Storage,
    plan: RankSavePlan,
    entry_bytes: Sequence[Buffer],
    file_parts: dict[str, list[Buffer]],
    threads: int,
) -> list[int]:
    """Write this rank's files in parallel, checksumming each entry (plan order) alongside."""
    by_file: dict[str, list[int]] = {}
    for i, e in enumerate(plan.entries):
        by_file.setdefault(e.file, []).append(i)
        if len(entry_bytes[i]) != e.byte_length:
            raise CheckpointError(f"{e.file}: entry {i} has {len(entry_bytes[i])} bytes, plan says {e.byte_length}")
    crcs = [0] * len(plan.entries)

    def checksum(name: str) -> None:
        for i in by_file[name]:
            crcs[i] = crc32c.crc32c(entry_bytes[i])

    def write(name: str) -> None:
        with phase("save.write.file", plan.rank, path=name, save_id=plan.save_id) as p:
            storage.write(name, file_parts.get(name, []))
            p.nbytes = sum(plan.entries[i].byte_length for i in by_file[name])

    jobs = [(fn, n) for n in by_file for fn in (write, checksum)]
    with ThreadPoolExecutor(max(1, min(threads, len(jobs))), thread_name_prefix="unickpt-write") as pool:
        for f in [pool.submit(fn, n) for fn, n in jobs]:
            f.result()
    return crcs


def build_metadata(
    gplan: GlobalSavePlan,
    crcs_by_rank: list[list[int]],
    request: SaveRequest,
    world_size: int,
    objects: dict[str, JSONValue],
) -> Metadata:
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
        format_version=OLDEST_FORMAT_VERSION,
        save_id=gplan.save_id,
        created_unix=time.time(),
        topology=Topology(request.framework, world_size, request.mesh),
        files=gplan.files,
        tensors=tensors,
        objects=objects,
        blobs=blobs,
        role=request.role,
    )


def commit_stage(
    coord: Coordinator,
    storage: Storage,
    gplan: GlobalSavePlan | None,
    crcs: list[int] | None,
    error: BaseException | None,
    request: SaveRequest,
    objects: dict[str, JSONValue],
    cleanup_previous: bool,
    still_locked: Callable[[], None] | None = None,
) -> Metadata | None:
    """Collective: agree that every rank wrote, then rank 0 commits. Returns the metadata on rank 0.

    Before publishing, rank 0 checks every data file (``check_written_files``) and calls
    ``still_locked`` (``SaveLock.verify_holder``), which raises if the save lost its lock."""

    def local() -> list[int]:
        if error is not None:
            raise error
        assert crcs is not None
        return crcs

    run_stage(coord, "save (write)", local)
    emit("save.commit.begin", coord.rank, save_id=gplan.save_id if gplan else "", path=storage.url)
    gathered = coord.gather_object((crcs, objects))  # the objects ride along: no extra round trip

    def finalize() -> Metadata | None:
        if coord.rank != 0:
            return None
        assert gplan is not None and gathered is not None
        merged = merge_rank_objects([o for _, o in gathered])
        md = build_metadata(gplan, [c for c, _ in gathered], request, coord.world_size, merged)
        sync_dir = getattr(storage, "sync_dir", None)
        if sync_dir is not None:
            for d in dict.fromkeys(f.rsplit("/", 1)[0] for f in gplan.files):
                sync_dir(d)
            sync_dir(DATA_DIR)
        check_written_files(storage, gplan)
        if still_locked is not None:
            still_locked()
        previous = committed_save_id(storage) if cleanup_previous else None
        storage.commit(METADATA_FILE, encode_metadata(md))
        emit("save.commit", coord.rank, save_id=md.save_id, path=storage.url)
        if cleanup_previous:
            try:
                remove_stale_data(storage, keep=(md.save_id, previous))
            except Exception as e:  # committed: the new checkpoint is fine, only old data remains
                _warn_cleanup_failed(storage, (md.save_id, previous), e)
        return md

    return run_stage(coord, "save (commit)", finalize)


def _warn_cleanup_failed(storage: Storage, keep: tuple[str | None, ...], error: Exception) -> None:
    """After the commit, old data could not be removed: a warning naming what is left and why
    (the save itself succeeded; the next save at this path retries the cleanup)."""
    try:  # unickpt's own leftovers only: the data of marked save ids other than the kept ones
        stale = [sid for sid in marked_save_ids(storage) if sid not in keep]
        left = [n for sid in stale for n in storage.list(f"{DATA_DIR}/{sid}/")]
    except Exception:
        left = []
    shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
    warnings.warn(
        f"checkpoint {storage.url} (save {keep[0]}) is committed and loads, but removing the data of "
        f"earlier saves failed: {type(error).__name__}: {error}. "
        + (f"Left behind: {shown}. " if left else "")
        + "The next save at this path retries; or delete those files by hand.",
        stacklevel=3,
    )


def committed_save_id(storage: Storage) -> str | None:
    """The save id of the checkpoint committed at ``storage`` now, or None (none / unreadable)."""
    try:
        data = storage.read(METADATA_FILE)
        doc = json.loads(data.decode("utf-8")) if data is not None else None
    except (CheckpointError, ValueError, UnicodeDecodeError):
        return None
    sid = doc.get("save_id") if isinstance(doc, dict) else None
    return sid if isinstance(sid, str) else None


def check_written_files(storage: Storage, gplan: GlobalSavePlan, threads: int = 16) -> None:
    """Rank 0, right before the commit: every data file the metadata will name exists with the
    size its writer gave it (missing or short: ``MissingDataFileError`` / ``TruncatedDataFileError``,
    nothing is published)."""
    want: dict[str, tuple[int, int]] = {}  # file -> (size, writing rank)
    for rp in gplan.rank_plans:
        for e in rp.entries:
            want[e.file] = (max(want.get(e.file, (0, 0))[0], e.byte_offset + e.byte_length), rp.rank)
    if not want:
        return
    names = list(want)
    with ThreadPoolExecutor(max(1, min(threads, len(names))), thread_name_prefix="unickpt-stat") as pool:
        sizes = list(pool.map(storage.size, names))
    for name, size in zip(names, sizes):
        expected, rank = want[name]
        where = f"refusing to commit save {gplan.save_id}: data file {storage.url}/{name} (written by rank {rank})"
        if size is None:
            raise MissingDataFileError(f"{where} is missing; nothing was published")
        if size != expected:
            raise TruncatedDataFileError(f"{where} has {size} bytes, not the {expected} written; nothing was published")


def remove_stale_data(storage: Storage, keep: tuple[str | None, ...]) -> None:
    """Delete the data of unickpt's own earlier or interrupted saves at this path (rank 0, after a
    successful commit, under the save lock): every save id a data marker names, except ``keep``
    (the save just committed and the one it replaced, which stays until the next commit here, so
    a load that read the old metadata a moment ago can still finish). A kept id that the
    metadata named but no marker does (a checkpoint of an older unickpt) gets its marker now.
    Only unickpt's data files and markers are deleted (``engine.ownership``), never other files."""
    kept = {sid for sid in keep if sid and is_save_id(sid)}
    marked = set(marked_save_ids(storage))
    for sid in sorted(kept - marked):
        mark_save(storage, sid)
    for sid in sorted(marked - kept):
        if delete_save_data(storage, sid):
            storage.delete([marker_name(sid)])
    tmp = [n for n in storage.list(METADATA_FILE + ".tmp-") if "/" not in n]
    if tmp:
        storage.delete(tmp)
