"""Deleting one whole unickpt checkpoint at a path (what a trainer's "keep the best k" removes).

Only unickpt's own names go, in ``folder.cleanup.delete_checkpoint``'s order (the metadata
first: the checkpoint turns incomplete before any data goes; then the data files, markers, lock
generations); a local folder left empty is removed last. A file of the user's in the folder
stays, and so does the folder then. A path that holds no unickpt checkpoint, or one a save holds
the lock of, is left alone (returns False), and so is a path that is a link: the link is not
unickpt's and is never followed (the checkpoint it points to stays whole). The caller waits for
its pending saves first.
"""

from __future__ import annotations

import os

from ..folder.cleanup import delete_checkpoint as delete_owned_files
from ..storage import open_storage

__all__ = ["delete_checkpoint"]


def delete_checkpoint(path: str) -> bool:
    """Delete the unickpt checkpoint at ``path`` (rank 0 only); False if there is none."""
    if "://" not in path and os.path.islink(os.path.expanduser(path).rstrip(os.sep) or os.sep):
        return False
    if not delete_owned_files(open_storage(path)):
        return False
    if "://" not in path:
        try:
            os.rmdir(path)  # only when nothing of the user's is left
        except OSError:
            pass
    return True
