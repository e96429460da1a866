"""The commit stage of a save: the barrier of every rank's write, then rank 0 publishes.

Runs on every rank after its write stage, inside the save lock
(``folder.lock.run_locked``): ``commit_stage`` reports this rank's file sizes, chunk checksums
and JSON objects (or its write failure) through the job's store
(``coordination.barrier.commit_barrier``, on the checkpointer's background coordinator: no
collective), and rank 0, once every rank reported, merges the objects (``planning.objects``:
optimizer param groups per parameter), builds the metadata (``format.build.build_metadata``),
syncs the data folders (where the storage ``needs_sync``), checks that every data file it names
is on storage in full (``check_written_files``) and that the save still holds its lock,
publishes the metadata atomically (``folder.publish.publisher_for``: the commit), then removes
the data of unickpt's own older saves (``folder.cleanup.remove_stale_data``) and the files of
the replaced checkpoint's Hugging Face export (``folder.hf_files.remove_stale_hf_export``,
whatever ``cleanup_previous`` says: they describe a model no longer there); a failure there is
only a warning: the checkpoint is committed.
With ``phases`` (``SaveOptions.record_phases``) each rank's phase records ride along with its
report, and rank 0 writes them all into the committed checkpoint (``monitoring.phases``).
A failure on any rank surfaces on every rank as the same error (``run_stage``).
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from typing import Any

from ...coordination.barrier import commit_barrier
from ...coordination.base import Coordinator
from ...errors import MissingDataFileError, TruncatedDataFileError
from ...folder.cleanup import remove_stale_data
from ...folder.files import written_problems
from ...folder.hf_files import remove_stale_hf_export
from ...folder.markers import marked_save_ids
from ...folder.probe import committed_save_id
from ...folder.publish import publisher_for
from ...format.build import RankSums, SaveSource, build_metadata
from ...format.codec import encode_metadata
from ...format.records import DATA_DIR, METADATA_FILE, JSONValue, Metadata
from ...monitoring.events import EventBus
from ...monitoring.phases import PhaseRecorder, encode_phases, phases_name
from ...planning.objects import merge_rank_objects
from ...planning.save.model import GlobalSavePlan, data_path
from ...storage.base import Storage

__all__ = ["commit_stage", "check_written_files"]


def commit_stage(
    coord: Coordinator,
    storage: Storage,
    save_id: str,
    gplan: GlobalSavePlan | None,
    sums: RankSums | None,
    error: BaseException | None,
    source: SaveSource,
    objects: dict[str, JSONValue],
    cleanup_previous: bool,
    events: EventBus,
    still_locked: Callable[[], None] | None = None,
    phases: PhaseRecorder | None = None,
) -> Metadata | None:
    """Every rank reports its write, then rank 0 commits. Returns the metadata on rank 0.
    ``gplan``: the global plan, on rank 0 only (the other ranks know only ``save_id``).

    Before publishing, rank 0 checks every data file (``check_written_files``) and calls
    ``still_locked`` (``SaveLock.verify_holder``), which raises if the save lost its lock.
    ``phases``: this save's phase records on this rank, kept in the checkpoint (rank 0 writes
    every rank's once the metadata is published; None: none)."""

    times = {"barrier": time.perf_counter()}
    reported: list[list[list[Any]]] = []  # rank 0: every rank's phase records, from its report

    def report() -> bytes:  # this rank's part of the commit: its file checksums and objects
        if error is not None:
            raise error
        assert sums is not None
        events.emit("save.commit.begin", coord.rank, save_id=save_id, path=storage.url)
        times["barrier"] = time.perf_counter()
        # the objects (already JSON: encoded values) and the phase records ride along; plain
        # JSON, never pickle
        part = [sums, objects] if phases is None else [sums, objects, phases.rows()]
        return json.dumps(part, separators=(",", ":"), allow_nan=False).encode()

    def decided() -> None:  # every rank wrote; rank 0 commits now
        events.emit("save.barrier", coord.rank, times["barrier"], save_id=save_id, path=storage.url)
        times["finalize"] = time.perf_counter()

    def finalize(payloads: list[bytes]) -> Metadata:
        assert gplan is not None
        gathered = [json.loads(p) for p in payloads]
        reported.extend(g[2] if len(g) > 2 else [] for g in gathered)
        merged = merge_rank_objects([g[1] for g in gathered])
        md = build_metadata(gplan, [g[0] for g in gathered], source, coord.world_size, merged)
        if storage.capabilities.needs_sync:  # the data files' names, before the metadata names them
            if gplan.files:  # the save's data folder
                storage.sync(data_path(gplan.save_id, gplan.files[0]).rsplit("/", 1)[0])
            storage.sync(DATA_DIR)
        if not storage.capabilities.node_local:  # node-local RAM: recovery.replicate checks every chunk
            check_written_files(storage, gplan)
        if still_locked is not None:
            still_locked()
        previous = committed_save_id(storage) if cleanup_previous else None
        publisher_for(storage).publish(METADATA_FILE, encode_metadata(md))
        events.emit("save.commit", coord.rank, save_id=md.save_id, path=storage.url)
        if cleanup_previous:
            try:
                remove_stale_data(storage, keep=(md.save_id, previous))
            except Exception as e:  # committed: the new checkpoint is fine, only old data remains
                _warn_cleanup_failed(storage, (md.save_id, previous), e)
        try:
            remove_stale_hf_export(storage)
        except Exception as e:
            warnings.warn(
                f"checkpoint {storage.url} (save {md.save_id}) is committed and loads, but removing the Hugging "
                f"Face export of the checkpoint it replaced failed: {type(e).__name__}: {e}. Its huggingface/ "
                "folder describes an older model: delete it by hand (a save with hf_export retries)",
                stacklevel=2,
            )
        return md

    # every rank reports through the job's store (no collective), rank 0 commits once all have
    # (coordination.barrier); a failure anywhere surfaces on every rank as the same error
    committed = commit_barrier(
        coord, save_id, report, finalize, stage="save (write)", commit_stage="save (commit)", on_decided=decided
    )
    events.emit("save.finalize", coord.rank, times.get("finalize"), save_id=save_id, path=storage.url)
    if committed is not None and phases is not None:  # rank 0: its own records are complete now
        _keep_phases(storage, committed.save_id, [phases.rows(), *reported[1:]])
    return committed


def _keep_phases(storage: Storage, save_id: str, ranks: list[list[list[Any]]]) -> None:
    """Rank 0, after the commit: every rank's phase records into the checkpoint
    (``monitoring.phases``); a failure is a warning (the checkpoint is committed)."""
    try:
        storage.write(phases_name(save_id), [encode_phases(save_id, ranks)])
    except Exception as e:
        warnings.warn(
            f"checkpoint {storage.url} (save {save_id}) is committed, but its phase records could not be "
            f"written ({type(e).__name__}: {e}); `unickpt report` will find none for it",
            stacklevel=3,
        )


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


def check_written_files(storage: Storage, gplan: GlobalSavePlan, threads: int = 16) -> None:
    """Rank 0, right before the commit: every data file the metadata will name is a regular file
    of exactly the size its writer gave it (``folder.files.written_problems``: missing ->
    ``MissingDataFileError``, another size, longer too -> ``TruncatedDataFileError``, a link ->
    the storage's error; nothing is published)."""
    want = gplan.file_ends()  # file -> (size, writing rank)
    if not want:
        return
    names = {data_path(gplan.save_id, f): f for f in want}
    for bad in written_problems(storage, {n: want[f][0] for n, f in names.items()}, threads):
        rank = want[names[bad.name]][1]
        where = f"refusing to commit save {gplan.save_id}: data file {storage.url}/{bad.name} (written by rank {rank})"
        if bad.refused is not None:
            raise bad.refused  # a link or a special file in its place: the storage's own error
        if bad.size is None:
            raise MissingDataFileError(f"{where} is missing; nothing was published")
        extra = " (bytes this save did not write: another writer in this folder?)" if bad.size > bad.expected else ""
        raise TruncatedDataFileError(
            f"{where} has {bad.size} bytes, not the {bad.expected} written{extra}; nothing was published"
        )
