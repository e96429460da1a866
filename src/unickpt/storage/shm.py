"""``shm://name``: checkpoints in shared memory, visible to every process of one machine.

``memory://`` lives inside one process (a dict); ``shm://`` is the same idea for multi-process
jobs: the files live on the tmpfs ``/dev/shm`` (RAM, no disk), under
``/dev/shm/unickpt-<uid>/<name>``, so the ranks of one host save and load them like local files
(every safety rule of the local backend applies: exclusive creates, no links followed, only
unickpt's files deleted). They survive the processes (not a reboot) until deleted, e.g. by a
``CheckpointManager``'s retention. Use it for in-memory checkpoints between the ranks of one node
and for fast multi-process tests. The ``UNICKPT_SHM_ROOT`` variable (read when a backend is
created) moves it to another tmpfs.
"""

from __future__ import annotations

import errno
import os

from ..errors import StorageError
from .base import check_name
from .local import CAPABILITIES, LocalStorage
from .options import StorageOptions

__all__ = ["ShmStorage", "shm_base"]

SHM_ROOT_ENV = "UNICKPT_SHM_ROOT"


def shm_base(options: StorageOptions | None = None) -> str:
    """The folder that holds this user's ``shm://`` checkpoints."""
    root = os.environ.get(SHM_ROOT_ENV, "/dev/shm")
    return os.path.join(root, f"unickpt-{os.getuid()}")


class ShmStorage(LocalStorage):
    """The files of ``shm://<path>`` (see the module docstring)."""

    capabilities = CAPABILITIES

    def __init__(self, path: str, options: StorageOptions | None = None) -> None:
        name = path.strip("/")
        if not name:
            raise StorageError(errno.EINVAL, "shm:// needs a name, e.g. shm://job1/step_10")
        check_name(name, "shm://")
        base = shm_base(options)
        os.makedirs(base, mode=0o700, exist_ok=True)
        if os.path.islink(base) or not os.path.isdir(base):
            raise StorageError(errno.EINVAL, f"{base} must be a folder (not a link) for shm:// checkpoints")
        plain = StorageOptions(retry=(options or StorageOptions()).retry, direct_writes=False, direct_reads=False)
        super().__init__(os.path.join(base, name), plain)  # tmpfs: no O_DIRECT, the page cache *is* the data
        self.url = f"shm://{name}"

    def __repr__(self) -> str:
        return f"ShmStorage({self.url!r})"
