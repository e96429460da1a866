"""Deleting one whole unickpt checkpoint at a path (what a trainer's "keep the best k" removes).

Only unickpt's own names go (``engine.ownership``): the metadata first (the checkpoint turns
incomplete before any data goes), then each marked save's data files, then their markers and the
save-lock generations; a local folder left empty is removed last. A file of the user's in the
folder stays, and so does the folder then. A path that holds no unickpt checkpoint is left alone
(returns False). The caller waits for its pending saves first.
"""

from __future__ import annotations

import os

from ..engine.ownership import LOCK_FILE, MARKER_PREFIX, delete_save_data, is_unickpt_name, marked_save_ids, marker_name
from ..format.records import METADATA_FILE
from ..storage import open_storage
from ..storage.commit import publisher_for

__all__ = ["delete_checkpoint"]


def delete_checkpoint(path: str) -> bool:
    """Delete the unickpt checkpoint at ``path`` (rank 0 only); False if there is none."""
    storage = open_storage(path)
    publisher = publisher_for(storage)
    top = [n for n in storage.list("") if "/" not in n]
    ours = [n for n in top if is_unickpt_name(n, publisher)]
    if not ours:
        return False
    if METADATA_FILE in ours:
        storage.delete([METADATA_FILE])
    leftovers = [n for n in ours if n != METADATA_FILE and not n.startswith(LOCK_FILE)]
    done = []
    for save_id in marked_save_ids(storage):
        if delete_save_data(storage, save_id):
            done.append(marker_name(save_id))
    rest = [n for n in leftovers if n in done or not n.startswith(MARKER_PREFIX)]
    locks = [n for n in ours if n.startswith(LOCK_FILE)]
    if rest or locks:
        storage.delete(rest + locks)
    if "://" not in path:
        try:
            os.rmdir(path)  # only when nothing of the user's is left
        except OSError:
            pass
    return True
