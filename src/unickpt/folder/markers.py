"""What in a checkpoint folder is unickpt's: the only things it ever deletes.

A checkpoint folder holds, at its top level, unickpt's own names only: the metadata
(``unickpt.metadata.json``, and the temporaries its publisher makes while it is committed, see
``folder.publish``), the save lock
(``unickpt.save.lock.<generation>``, see ``folder.lock``) and one *data marker* per save whose
data may be on disk (``unickpt.data.<save_id>``); and the data files under ``data/<save_id>/``.

Order of use:
  1. ``check_save_folder``  rank 0, before the save writes anything (``folder.lock``): a folder
     that is not empty and holds none of unickpt's top-level names (and no sub-folder that does:
     ``role`` sub-checkpoints, manager steps) belongs to someone else: ``ForeignFolderError``.
  2. ``mark_save``  rank 0, under the save lock, before any data byte is written: the marker
     names the save, so that an interrupted save is recognisable and cleaned later.
  3. after the commit ``folder.cleanup.remove_stale_data`` deletes, for every *marked* save id
     other than the committed one and the one it replaced, the data files of that save
     (``delete_save_data``: names of the form unickpt gives its data files, and the save's
     ``phases.json``, under ``data/<save_id>/``) and then its marker. A failed save discards its own (``folder.lock``);
     ``folder.cleanup.delete_checkpoint`` deletes a whole checkpoint's.
Nothing else is ever deleted: a file of the user's under ``data/`` (or next to unickpt's files
in ``data/<save_id>/``) stays, whatever its name.
"""

from __future__ import annotations

import json
import re
import time

from ..errors import ForeignFolderError
from ..format.records import DATA_DIR, METADATA_FILE
from ..storage.base import Storage
from .publish import Publisher, publisher_for

__all__ = [
    "LOCK_FILE",
    "MARKER_PREFIX",
    "lock_generation",
    "is_save_id",
    "is_unickpt_name",
    "check_save_folder",
    "marker_name",
    "mark_save",
    "marked_save_ids",
    "delete_save_data",
    "is_data_file_name",
]

LOCK_FILE = "unickpt.save.lock"  # the lock's generations are LOCK_FILE + ".<n>", n >= 1 (folder.lock)
MARKER_PREFIX = "unickpt.data."
_LOCK_GENERATION = re.compile(re.escape(LOCK_FILE) + r"\.([1-9][0-9]{0,17})")
_SAVE_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z_-]{0,127}")
# planning.save.model.file_name, and the save's phase records (monitoring.phases.PHASES_FILE)
_DATA_FILE = re.compile(r"r\d{5,}-\d{2,}\.bin|phases\.json")


def is_save_id(text: str) -> bool:
    """Whether ``text`` can be a unickpt save id (no '/', no '.', nothing that leaves a folder)."""
    return _SAVE_ID.fullmatch(text) is not None


def lock_generation(name: str) -> int | None:
    """The generation ``n`` of a save-lock file named ``unickpt.save.lock.<n>`` (as ``folder.lock``
    writes it: n >= 1, no leading zero), None for any other name: a bare ``unickpt.save.lock``
    is not a lock file of this format, and is neither read nor deleted."""
    m = _LOCK_GENERATION.fullmatch(name)
    return None if m is None else int(m.group(1))


def is_data_file_name(base: str) -> bool:
    """Whether ``base`` (a name inside ``data/<save_id>/``) has the form unickpt gives its data files."""
    return _DATA_FILE.fullmatch(base) is not None


def is_unickpt_name(name: str, publisher: Publisher) -> bool:
    """Whether a top-level ``name`` is one unickpt writes into a checkpoint folder (whose
    metadata ``publisher`` commits: its leftovers count)."""
    return (
        name == METADATA_FILE
        or publisher.is_leftover(name, METADATA_FILE)
        or name.startswith(LOCK_FILE + ".")  # a lock generation, or its publisher's temporary
        or name.startswith(MARKER_PREFIX)
    )


def check_save_folder(storage: Storage) -> None:
    """Rank 0, before a save writes anything: raise ``ForeignFolderError`` unless the folder is
    empty (or missing), holds one of unickpt's top-level names, or holds only sub-folders that
    do (``path/<role>`` checkpoints, ``CheckpointManager`` steps) and empty folders."""
    publisher = publisher_for(storage)
    if any(is_unickpt_name(n, publisher) for n in storage.list("unickpt.") if "/" not in n):
        return  # the common case, one cheap listing of the top level
    names = storage.list("")
    subs: dict[str, list[str]] = {}
    foreign = []
    for n in names:
        first, sep, rest = n.partition("/")
        if sep:
            subs.setdefault(first, []).append(rest)
        else:
            foreign.append(n)
    for sub, rests in subs.items():
        if not any("/" not in r and is_unickpt_name(r, publisher) for r in rests):
            foreign.append(f"{sub}/{rests[0]}")
    if foreign:
        raise ForeignFolderError(
            f"refusing to save into {storage.url}: the folder is not empty and is not a unickpt checkpoint "
            f"(no {METADATA_FILE}, save lock or data marker); it holds e.g. {sorted(foreign)[:3]}. "
            "unickpt never writes into, or deletes from, a folder it did not create: save to a new or "
            "empty folder (if these are leftovers of an interrupted save of an older unickpt, delete them)"
        )


def marker_name(save_id: str) -> str:
    return MARKER_PREFIX + save_id


def mark_save(storage: Storage, save_id: str) -> None:
    """Record that unickpt writes (or wrote) ``data/<save_id>/`` here (an exclusive create
    through the publisher; an existing marker of that id is kept)."""
    if not is_save_id(save_id):
        raise ValueError(f"not a unickpt save id: {save_id!r}")
    data = json.dumps({"save_id": save_id, "created_unix": time.time()}).encode("utf-8")
    publisher_for(storage).create(marker_name(save_id), data)


def marked_save_ids(storage: Storage) -> list[str]:
    """The save ids whose data markers are in the folder."""
    n = len(MARKER_PREFIX)
    return [m[n:] for m in storage.list(MARKER_PREFIX) if "/" not in m and is_save_id(m[n:])]


def delete_save_data(storage: Storage, save_id: str) -> bool:
    """Delete the data files of ``save_id`` (names of unickpt's data-file form directly under
    ``data/<save_id>/``); True when none is left (its marker may go: what remains there, if
    anything, is not unickpt's)."""
    if not is_save_id(save_id):
        return False
    prefix = f"{DATA_DIR}/{save_id}/"
    ours = [n for n in storage.list(prefix) if _DATA_FILE.fullmatch(n[len(prefix) :])]
    if ours:
        storage.delete(ours)
    return not any(_DATA_FILE.fullmatch(n[len(prefix) :]) for n in storage.list(prefix))
