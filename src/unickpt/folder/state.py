"""What one checkpoint folder is, in the words ``unickpt ls`` prints, and every unickpt checkpoint
below a folder that is not a ``CheckpointManager`` root.

  ``folder_state``       the state of the checkpoint at ``prefix`` in a storage: complete,
                         incomplete (no metadata; unickpt's lock, marker or publication
                         leftover, or its export's record: a save in progress or interrupted),
                         damaged (a data file missing, not a regular file or short:
                         ``folder.files``), unreadable (metadata this version cannot decode) or
                         foreign (nothing unickpt writes). ``CheckpointManager.step_states`` (its
                         step folders, retention, ``unickpt ls``) and ``find_checkpoints`` use it;
                         ``folder.probe.read_metadata_bytes`` (load, ``inspect``, ``verify``) calls
                         an interrupted save by the same word, with the same reason (``UNFINISHED``).
  ``find_checkpoints``   ``unickpt ls`` of a folder without step folders (a Lightning ``dirpath``,
                         an HF Trainer ``output_dir`` with ``checkpoint-N/unickpt``, the folders
                         of ``unickpt.save("ckpts/step_100")``): every folder at most
                         ``MAX_DEPTH`` levels below holding a name unickpt writes, found without
                         following a link (a local folder is walked through directory file
                         descriptors opened with ``O_NOFOLLOW``; another storage's listing never
                         enters links), each with its ``folder_state``.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from ..errors import CheckpointError
from ..format.hf_manifest import HF_FOLDER
from ..format.records import DATA_DIR, Metadata
from ..storage.base import Storage
from ..storage.registry import split_url
from .files import data_files, problems
from .hf_files import describe_hf_export
from .markers import is_unickpt_name
from .probe import SEARCH_DEPTH, UNFINISHED, committed_metadata
from .publish import Publisher, publisher_for

__all__ = [
    "COMPLETE",
    "INCOMPLETE",
    "DAMAGED",
    "UNREADABLE",
    "FOREIGN",
    "STATUSES",
    "UNFINISHED",
    "MAX_DEPTH",
    "FolderState",
    "folder_state",
    "find_checkpoints",
]

COMPLETE = "complete"  # metadata decoded, every data file complete (``folder.files``: longer is complete)
INCOMPLETE = "incomplete"  # no metadata, unickpt's lock / marker: a save in progress or interrupted
DAMAGED = "damaged"  # metadata decoded, a data file it names missing, not a regular file or short
UNREADABLE = "unreadable"  # metadata this unickpt cannot decode: a newer format, corrupt, too large
FOREIGN = "foreign"  # no metadata and no file unickpt writes: only another program's files
STATUSES = (COMPLETE, INCOMPLETE, DAMAGED, UNREADABLE, FOREIGN)

MAX_DEPTH = SEARCH_DEPTH  # find_checkpoints: folder levels below the one given (checkpoint-8/unickpt is 2)


@dataclass(frozen=True, slots=True)
class FolderState:
    """``status``: one of ``STATUSES``; ``metadata``: the decoded metadata (complete and damaged
    folders); ``reason``: why it is not complete; ``hf_export``: a few words on unickpt's
    Hugging Face export in its ``huggingface/`` folder, "" when there is none."""

    status: str
    metadata: Metadata | None = None
    reason: str = ""
    hf_export: str = ""


def folder_state(
    storage: Storage, prefix: str, names: list[str] | None, where: str, publisher: Publisher | None = None
) -> FolderState:
    """The state of the checkpoint at ``prefix`` (``names``: its names under the storage's root,
    listed when needed if None, and then no export is described; ``where``: its metadata file as
    errors name it)."""
    publisher = publisher if publisher is not None else publisher_for(storage)
    try:
        md = committed_metadata(storage, prefix, where=where)
    except CheckpointError as e:  # a newer format version, corrupt, too large, a link
        return FolderState(UNREADABLE, None, f"{type(e).__name__}: {e}")
    if md is None:
        if names is None:
            names = storage.list(prefix)
        top = [n[len(prefix) :] for n in names if n.startswith(prefix) and "/" not in n[len(prefix) :]]
        hf = describe_hf_export(storage, prefix, names, None)
        if any(is_unickpt_name(n, publisher) for n in top):
            return FolderState(INCOMPLETE, None, UNFINISHED, hf)
        if hf:  # what a deletion interrupted half-way leaves: unickpt's export record
            return FolderState(INCOMPLETE, None, "no metadata: only unickpt's Hugging Face export is left", hf)
        return FolderState(FOREIGN, None, "no metadata and no file unickpt writes")
    hf = describe_hf_export(storage, prefix, names, md.save_id) if names is not None else ""
    bad = problems(data_files(storage, md, prefix))
    if bad:
        return FolderState(DAMAGED, md, bad[0].describe(), hf)
    return FolderState(COMPLETE, md, "", hf)


def find_checkpoints(storage: Storage, max_depth: int = MAX_DEPTH) -> list[tuple[str, FolderState]]:
    """Every checkpoint folder in ``storage`` at most ``max_depth`` levels below its root (the
    root itself included): its path relative to the root ("" for the root) and its state, by
    path. A checkpoint's own ``data/`` and ``huggingface/`` folders are not searched; its other
    sub-folders are (the checkpoints of its roles)."""
    publisher = publisher_for(storage)
    scheme, rest = split_url(storage.url)
    folders = _local_folders(os.path.expanduser(rest), max_depth, publisher) if scheme == "file" else None
    if folders is None:
        folders = _listed_folders(storage.list(""), max_depth, publisher)
    out = []
    for rel in sorted(folders):
        prefix = f"{rel}/" if rel else ""
        names = storage.list(prefix)
        out.append((rel, folder_state(storage, prefix, names, f"{storage.url}/{prefix}", publisher)))
    return out


def _is_checkpoint(files: list[str], publisher: Publisher) -> bool:
    return any(is_unickpt_name(n, publisher) for n in files)


def _listed_folders(names: list[str], max_depth: int, publisher: Publisher) -> list[str]:
    """The checkpoint folders among a storage's names (a listing that never enters links)."""
    files: dict[str, list[str]] = {}
    for n in names:
        head, _, base = n.rpartition("/")
        if head.count("/") + (1 if head else 0) <= max_depth:
            files.setdefault(head, []).append(base)
    found = {d for d, fs in files.items() if _is_checkpoint(fs, publisher)}
    inside = {f"{d}/{sub}" if d else sub for d in found for sub in (DATA_DIR, HF_FOLDER)}
    return [d for d in found if not any(d == i or d.startswith(i + "/") for i in inside)]


def _local_folders(root: str, max_depth: int, publisher: Publisher) -> list[str] | None:
    """The checkpoint folders under the local folder ``root``, each folder opened from ``root``
    one component at a time with ``O_NOFOLLOW`` (a link is never entered, also one swapped in
    during the walk); None when ``root`` is no folder."""
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    found: list[str] = []
    try:
        stack: list[tuple[str, int]] = [("", 0)]
        while stack:
            rel, depth = stack.pop()
            entries = _entries(top, rel)
            files = [n for n, mode in entries if stat.S_ISREG(mode)]
            checkpoint = _is_checkpoint(files, publisher)
            if checkpoint:
                found.append(rel)
            if depth < max_depth:
                for name, mode in sorted(entries, reverse=True):
                    if stat.S_ISDIR(mode) and not (checkpoint and name in (DATA_DIR, HF_FOLDER)):
                        stack.append((f"{rel}/{name}" if rel else name, depth + 1))
    finally:
        os.close(top)
    return found


def _entries(top: int, rel: str) -> list[tuple[str, int]]:
    """(name, mode) of every entry of the folder ``rel`` below the open folder ``top`` (modes
    of the entries themselves, links not followed); [] when it cannot be opened as a folder
    without following a link, or read."""
    flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fds: list[int] = []
    try:
        fd = top
        for part in rel.split("/") if rel else []:
            fd = os.open(part, flags, dir_fd=fd)
            fds.append(fd)
        with os.scandir(fd) as it:  # on a duplicate of fd, closed with the iterator
            return [(e.name, e.stat(follow_symlinks=False).st_mode) for e in it]
    except OSError as e:  # a link in its place (ELOOP, ENOTDIR), gone, unreadable
        if e.errno not in (errno.ELOOP, errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM):
            raise
        return []
    finally:
        for fd in fds:
            os.close(fd)
