"""``shm://name``: checkpoints in shared memory, visible to every process of one machine.

``memory://`` lives inside one process (a dict); ``shm://`` is the same idea for multi-process
jobs: the files live on the tmpfs ``/dev/shm`` (RAM, no disk), under
``/dev/shm/unickpt-<uid>/<name>``, so the ranks of one host save and load them like local files
(every safety rule of the local backend applies: exclusive creates, no links followed, only
unickpt's files deleted). They survive the processes (not a reboot) until deleted, e.g. by a
``CheckpointManager``'s retention. Use it for in-memory checkpoints between the ranks of one node
and for fast multi-process tests. The ``UNICKPT_SHM_ROOT`` variable (read when a backend is
created) moves it to another tmpfs.

``/dev/shm`` is shared by every user of the machine, so the base folder ``unickpt-<uid>`` must be
this user's own: ``private_base`` creates it exclusively with mode 0700, and refuses one that is
a link, is owned by another user or lets the group or others in (``UnsafePathError`` naming the
folder and the fix), since whoever controls it could read, move, delete or redirect the
checkpoints below. Files are created 0600 and folders 0700 below it.
"""

from __future__ import annotations

import errno
import os
import stat

from ..errors import StorageError, UnsafePathError
from .base import check_name
from .local import CAPABILITIES, LocalStorage
from .options import StorageOptions

__all__ = ["ShmStorage", "folder_flaw", "shm_base", "private_base"]

SHM_ROOT_ENV = "UNICKPT_SHM_ROOT"


def shm_base(options: StorageOptions | None = None) -> str:
    """The folder that holds this user's ``shm://`` checkpoints."""
    root = os.environ.get(SHM_ROOT_ENV, "/dev/shm")
    return os.path.join(root, f"unickpt-{os.getuid()}")


def private_base(base: str) -> None:
    """Make ``base`` (mode 0700) unless it exists, then check that it is a folder (not a link)
    of this user that no one else may enter; ``UnsafePathError`` naming it and the fix if not."""
    try:
        os.makedirs(os.path.dirname(base), exist_ok=True)
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise StorageError(e.errno, f"cannot create the shm:// folder {base}: {e.strerror or e}") from None
    st = os.lstat(base)
    problem = folder_flaw(st, 0o077)
    fix = (
        f" (or, if nothing of another user's is in it, chmod 700 {base})"
        if problem and problem.startswith("has mode")
        else ""
    )
    if problem is not None:
        raise UnsafePathError(
            errno.EPERM,
            f"{base} {problem}: shm:// keeps this user's checkpoints there, so it must be a folder of "
            f"yours with mode 0700; remove it{fix} or set {SHM_ROOT_ENV} to a folder of your own",
        )


def folder_flaw(st: os.stat_result, others: int) -> str | None:
    """What makes the folder of ``lstat`` result ``st`` unsafe to hold this user's files, in words
    (a link, not a folder, another user's, mode bits of ``others`` set), or None. Called by
    ``private_base`` (``others`` 0o077: no one else may enter) and the RAM tier's folder check
    (``recovery.tier``: 0o022, no one else may write)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.getuid():
        return f"belongs to another user (uid {st.st_uid}, you are uid {os.getuid()})"
    if st.st_mode & others:
        return (
            f"has mode {stat.S_IMODE(st.st_mode):04o}: other users may {'enter' if others & 0o011 else 'write in'} it"
        )
    return None


class ShmStorage(LocalStorage):
    """The files of ``shm://<path>`` (see the module docstring)."""

    capabilities = CAPABILITIES
    file_mode = 0o600  # /dev/shm is shared by every user of the machine
    folder_mode = 0o700

    def __init__(self, path: str, options: StorageOptions | None = None) -> None:
        name = path.strip("/")
        if not name:
            raise StorageError(errno.EINVAL, "shm:// needs a name, e.g. shm://job1/step_10")
        check_name(name, "shm://")
        base = shm_base(options)
        private_base(base)
        plain = StorageOptions(retry=(options or StorageOptions()).retry, direct_writes=False, direct_reads=False)
        super().__init__(os.path.join(base, name), plain)  # tmpfs: no O_DIRECT, the page cache *is* the data
        self.url = f"shm://{name}"

    def __repr__(self) -> str:
        return f"ShmStorage({self.url!r})"
