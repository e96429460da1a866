"""Which of this host's RAM-tier folders are unsafe to use: links, foreign owners, open modes.

Called on a host's agent (pure checks, ``lstat`` only, never following a link, nothing written):

* ``ram_folder_problem(node_url)``: ``tier.tier_group`` before the tier's first collective (every
  rank, at construction): the shm base, every folder from it down to the root, the root's own
  folders (``recovery``, ``replicas``, ``replicas/<host>``, ``step_N``);
* ``step_folder_problem(node_url, stepdir, origins)``: ``tier.RamTier`` before each step's
  replication, durable copy and RAM retention: the above, and everything under the folders that
  step reads or writes on this host (``step_N/...``, ``replicas/<origin>/step_N/...``): a link or
  other non-regular file in a file's place, a folder flaw below.

Each answer is a one-line message naming the folder (or file) and the fix, or None; the callers
gather it through the tier's group (``group.TierGroup.fail_together``), so a host's unsafe
folder is the same ``ConfigurationError`` on every rank before any transfer starts.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable

from ..errors import ConfigurationError, StorageError
from ..storage.shm import folder_flaw, private_base, shm_base
from .inventory import safe_host

__all__ = ["ram_folder_problem", "step_folder_problem", "as_unsafe_folder"]

_WHY = "the RAM tier keeps this host's checkpoints and other hosts' replicas there"


def _root_of(node_url: str) -> tuple[str, list[str]]:
    """The host's RAM root of ``shmnode://<name>`` and every folder from the shm base down to it."""
    path, folders = shm_base(), []
    for part in node_url[len("shmnode://") :].strip("/").split("/"):
        path = os.path.join(path, part)
        folders.append(path)
    return path, folders


def ram_folder_problem(node_url: str) -> str | None:
    """What makes this host's RAM folders of ``shmnode://<name>`` unsafe, or None: the shm base
    (``storage.shm.private_base``: this user's, mode 0700, no link), then every existing folder
    from it down to the root, and the root's own folders (``recovery``, ``replicas``,
    ``replicas/<host>``, ``step_N``): a link, no folder, another user's, or writable by the
    group or others. Whoever controls one could plant, swap or delete the copies the job
    recovers from."""
    try:
        private_base(shm_base())
    except StorageError as e:  # UnsafePathError, or a base that cannot be created
        return e.strerror or str(e)
    root, folders = _root_of(node_url)
    folders += [os.path.join(root, "recovery"), os.path.join(root, "replicas")]
    for folder in folders:
        problem = _folder_problem(folder)
        if problem is not None:
            return problem
    for sub, prefix in ((root, "step_"), (os.path.join(root, "replicas"), "")):
        if os.path.isdir(sub):  # checked above: a real folder of ours, not a link
            for name in sorted(os.listdir(sub)):
                problem = _folder_problem(os.path.join(sub, name), listed=True) if name.startswith(prefix) else None
                if problem is not None:
                    return problem
    return None


def step_folder_problem(node_url: str, stepdir: str, origins: Iterable[str]) -> str | None:
    """``ram_folder_problem``, then the step's folders on this host: ``stepdir`` (the primaries)
    and ``replicas/<origin>/<stepdir>`` for each host in ``origins`` (those whose copies this host
    holds), each with everything below it: a folder that is a link, another user's or open to
    others, or a link (FIFO, device ...) where a file belongs. Regular files of any name pass:
    the tier reads and deletes only the files its markers name."""
    problem = ram_folder_problem(node_url)
    if problem is not None:
        return problem
    root, _ = _root_of(node_url)
    tops = [os.path.join(root, stepdir)]
    tops += [os.path.join(root, "replicas", safe_host(o), stepdir) for o in sorted(set(origins))]
    for top in tops:
        problem = _folder_problem(top) or (_tree_problem(top) if os.path.isdir(top) else None)
        if problem is not None:
            return problem
    return None


def _tree_problem(top: str) -> str | None:
    """The first unsafe entry below the folder ``top`` (checked by the caller), depth first,
    sorted; links are never followed (``os.walk`` without ``followlinks``, each entry ``lstat``'d)."""
    for folder, dirs, files in os.walk(top):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                continue
            if stat.S_ISDIR(st.st_mode):
                problem = _folder_problem(path)
            else:
                what = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a regular file"
                problem = f"{path} {what}; {_WHY}, so it never reads or writes through it: remove it"
            if problem is not None:
                return problem
    return None


def _folder_problem(path: str, listed: bool = False) -> str | None:
    """Why the folder ``path`` is unsafe (``ram_folder_problem``), or None; a file found by
    listing (``listed``) is some other file (the tier never reads it), not a folder out of place."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if listed and stat.S_ISREG(st.st_mode):
        return None
    what = folder_flaw(st, 0o022)
    if what is None:
        return None
    fix = "fix its owner and mode (chmod 700) or remove it"
    return f"{path} {what}; {_WHY}, so it must be a folder of yours that no one else can write: {fix}"


def as_unsafe_folder(error: Exception, check: Callable[[], str | None] | None) -> Exception:
    """A file error met because a folder of the step was swapped for a link or given away since
    the check before it (``check``): the ``ConfigurationError`` naming that folder, as the check
    would have raised; any other error as it is."""
    if check is None or not isinstance(error, OSError):
        return error
    try:
        problem = check()
    except Exception:
        return error
    if problem is None:
        return error
    unsafe = ConfigurationError(problem)
    unsafe.__cause__ = error
    return unsafe
