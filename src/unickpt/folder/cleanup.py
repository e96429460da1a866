"""Deleting what unickpt wrote into a checkpoint folder, and nothing else.

Two operations, both deleting only names unickpt provably wrote (``folder.markers``: the data
files of unickpt's form under ``data/<save_id>/`` of a marked or committed save, data markers,
save-lock generations, the metadata and its publisher's leftovers):
  ``remove_stale_data``  rank 0 after a successful commit, under the save lock
                         (``engine.save.commit``): the data of every marked save but the one
                         just committed and the one it replaced;
  ``delete_checkpoint``  one whole checkpoint (``CheckpointManager`` retention, tiering's fast
                         copies, a trainer's "keep the best k" through ``integrations``), in the
                         order ``checkpoint_files`` gives: the metadata first (the checkpoint
                         turns incomplete before any data goes), the data files, the markers,
                         then the lock generations and publication temporaries; the files of its
                         ``huggingface/`` export that unickpt wrote go with the data, their
                         record with the markers (``folder.hf_files``). Nothing is
                         deleted while a save holds the folder's lock (``lock_blocks_deletion``).
A file of the user's anywhere in the folder stays, whatever its name.
"""

from __future__ import annotations

from ..errors import CheckpointError
from ..format.hf_manifest import HF_FOLDER, MANIFEST_FILE
from ..format.records import DATA_DIR, METADATA_FILE
from ..storage.base import Storage
from .hf_files import hf_export_files
from .lock import lock_is_live
from .lock_owner import LockContext
from .markers import (
    MARKER_PREFIX,
    delete_save_data,
    is_data_file_name,
    is_save_id,
    lock_generation,
    mark_save,
    marked_save_ids,
    marker_name,
)
from .probe import committed_metadata
from .publish import publisher_for

__all__ = ["remove_stale_data", "lock_blocks_deletion", "checkpoint_files", "delete_files", "delete_checkpoint"]

FileGroups = tuple[tuple[str, ...], ...]  # names to delete, group after group


def remove_stale_data(storage: Storage, keep: tuple[str | None, ...]) -> None:
    """Delete the data of unickpt's own earlier or interrupted saves at this path (rank 0, after a
    successful commit, under the save lock): every save id a data marker names, except ``keep``
    (the save just committed and the one it replaced, which stays until the next commit here, so
    a load that read the old metadata a moment ago can still finish). A kept id that the
    metadata named but no marker does (a checkpoint of an older unickpt) gets its marker now.
    Only unickpt's data files and markers are deleted (``folder.markers``), and the leftovers of
    interrupted metadata publications that the publisher names as its own, never other files."""
    kept = {sid for sid in keep if sid and is_save_id(sid)}
    marked = set(marked_save_ids(storage))
    for sid in sorted(kept - marked):
        mark_save(storage, sid)
    for sid in sorted(marked - kept):
        if delete_save_data(storage, sid):
            storage.delete([marker_name(sid)])
    leftovers = publisher_for(storage).leftovers(METADATA_FILE)
    if leftovers:
        storage.delete(leftovers)


def lock_blocks_deletion(storage: Storage, prefix: str = "", locks: LockContext | None = None) -> bool:
    """Whether a save may be running in the checkpoint at ``prefix`` (its lock is live, or a lock
    file unickpt cannot read is there: not a small regular file), so nothing may be deleted."""
    try:
        return lock_is_live(storage, prefix, locks)
    except CheckpointError:
        return True


def checkpoint_files(
    storage: Storage, prefix: str = "", names: list[str] | None = None, locks: LockContext | None = None
) -> FileGroups:
    """The files of the checkpoint at ``prefix`` in ``storage`` that unickpt provably wrote, in the
    order to delete them (nothing while a save holds its lock): the metadata (the checkpoint
    turns incomplete before its data goes), the data files of unickpt's form under
    ``data/<save_id>/`` of the metadata's save and of every marked save and the files of its
    ``huggingface/`` export that unickpt wrote (``folder.hf_files``), their markers and the
    export's record, then the save lock's generations and the metadata's publication
    temporaries. Anything else (a user's file, a data file no marker or metadata proves
    unickpt's, a file in ``huggingface/`` the export's record does not name, a link) is never
    named. ``names``: the names under ``prefix`` (listed when None); ``locks``: this process's
    lock tokens."""
    if lock_blocks_deletion(storage, prefix, locks):
        return ()
    if names is None:
        names = storage.list(prefix)
    publisher = publisher_for(storage)
    rests = [n[len(prefix) :] for n in names if n.startswith(prefix)]
    top = [r for r in rests if "/" not in r]
    md = None
    if METADATA_FILE in top:
        try:
            md = committed_metadata(storage, prefix)
        except CheckpointError:  # not decodable: not provably unickpt's to delete
            md = None
    marked = {r[len(MARKER_PREFIX) :] for r in top if r.startswith(MARKER_PREFIX)}
    marked = {sid for sid in marked if is_save_id(sid)}
    save_ids = marked | ({md.save_id} if md is not None and is_save_id(md.save_id) else set())
    data = [r for r in rests if _is_data_file_of(r, save_ids)]
    locks_found = [r for r in top if lock_generation(r) is not None]
    temps = [r for r in top if publisher.is_leftover(r, METADATA_FILE)]
    hf = hf_export_files(storage, prefix, names)
    hf_ours = [n[len(prefix) :] for n in hf.ours]
    hf_record = [f"{HF_FOLDER}/{MANIFEST_FILE}"] if hf.manifest is not None else []
    hf_files = [r for r in hf_ours if r not in hf_record]
    groups = (
        [METADATA_FILE] if md is not None else [],
        data + hf_files,
        [marker_name(s) for s in sorted(marked)] + hf_record,
        locks_found + temps,
    )
    return tuple(tuple(prefix + r for r in g) for g in groups)


def delete_files(storage: Storage, groups: FileGroups) -> bool:
    """Delete ``groups`` (``checkpoint_files``) in order; True when there was anything to delete."""
    for group in groups:
        if group:
            storage.delete(list(group))
    return any(groups)


def delete_checkpoint(
    storage: Storage, prefix: str = "", names: list[str] | None = None, locks: LockContext | None = None
) -> bool:
    """Delete the files of the checkpoint at ``prefix`` that unickpt provably wrote
    (``checkpoint_files``), the metadata first, unless a save holds its lock. True when
    something was deleted (False: no unickpt checkpoint there, or a save holds it)."""
    return delete_files(storage, checkpoint_files(storage, prefix, names, locks))


def _is_data_file_of(rest: str, save_ids: set[str]) -> bool:
    """Whether ``rest`` (a name inside a checkpoint folder) is a data file of unickpt's form under
    ``data/<save_id>/`` of one of ``save_ids``."""
    head, sep, base = rest.rpartition("/")
    return (
        bool(sep)
        and head.startswith(f"{DATA_DIR}/")
        and head[len(DATA_DIR) + 1 :] in save_ids
        and is_data_file_name(base)
    )
