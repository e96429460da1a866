"""What a save or load is about: the checkpoint's storage (path + role); the ``state`` dict is
``state.layout``'s.

Used first by both pipelines (``SavePipeline``, ``LoadPipeline``), and by ``CheckpointManager``
for roles. ``claims`` is what every rank must pass alike; the pipelines check it in their first
collective (``run_stage(agree=...)``) before anything is written or read.
"""

from __future__ import annotations

import os

from ..errors import ConfigurationError, OutputInsideSourceError, UnsafePathError
from ..format.records import DATA_DIR
from ..storage import Storage, StorageOptions, local_files, open_storage

__all__ = ["check_role", "open_target", "claims", "prepare_output_folder", "refuse_nested_output"]


def check_role(role: str | None) -> None:
    """A role names a sub-folder of the checkpoint folder: one path component that cannot be
    taken for the folder's own files (``data/``, ``unickpt.*``) or hidden."""
    if role is None:
        return
    if not isinstance(role, str) or not role or "/" in role or "\\" in role or role.startswith("."):
        raise ValueError(f"invalid role {role!r}: one folder name, not empty, no '/', not starting with '.'")
    if role == DATA_DIR or role.startswith("unickpt"):
        raise ValueError(f"invalid role {role!r}: {DATA_DIR!r} and names starting with 'unickpt' are reserved")


def open_target(path: str, role: str | None, options: StorageOptions | None = None) -> Storage:
    """The storage of the checkpoint at ``path`` (``path/role`` with a role), opened with
    ``options`` (``SaveOptions.storage`` / ``LoadOptions.storage``)."""
    check_role(role)
    if role is not None:
        path = f"{str(path).rstrip('/')}/{role}"
    return open_storage(str(path), options)


def claims(operation: str, url: str, framework: str, role: str | None) -> dict[str, object]:
    """What every rank of one save/load must pass alike (checked in its first collective)."""
    return {"operation": operation, "path": url, "framework": framework, "role": role}


def prepare_output_folder(out: str, what: str, *, refuse_linked_parent: bool = False) -> None:
    """Create the local folder ``out`` that ``what`` (``"merge"``, ``"Hugging Face export"``)
    writes files into, or accept it if it exists empty; refuse a link at ``out`` (and at its
    parent with ``refuse_linked_parent``), a file, and a folder that holds anything (its files
    are never overwritten)."""
    for p in (os.path.dirname(out), out) if refuse_linked_parent else (out,):
        if p and os.path.islink(p):
            raise UnsafePathError(f"{what}: refusing to write into {p}: it is a symbolic link")
    if os.path.lexists(out):
        if not os.path.isdir(out):
            raise ConfigurationError(f"{what}: {out} exists and is not a folder")
        if os.listdir(out):
            raise ConfigurationError(f"{what}: {out} is not empty; {what} writes into a new or empty folder only")
    local_files.make_folders(out)


def refuse_nested_output(source: str, out: str, what: str) -> None:
    """``OutputInsideSourceError`` when the folder ``out`` that ``what`` (``"merge"``,
    ``"convert"``, ``"modify"``) writes is the source folder ``source`` or inside it, or
    ``source`` is inside ``out``. Both paths are resolved first (links, ``..``, relative paths),
    so ``ck/latest/inside`` with ``latest -> step_100`` counts. URLs (``s3://``) are another
    storage than a local output: not compared. Called before anything is read or written."""
    if "://" in source or "://" in out:
        return
    src, dst = os.path.realpath(source), os.path.realpath(out)
    if os.path.commonpath([src, dst]) == src:
        where = "is the source checkpoint" if src == dst else f"is inside the source checkpoint {source}"
        raise OutputInsideSourceError(
            f"{what}: the output folder {out} {where}: {what} never writes into its source; give an output "
            "folder outside it"
        )
    if os.path.commonpath([src, dst]) == dst:
        raise OutputInsideSourceError(
            f"{what}: the source {source} is inside the output folder {out}: {what} would write around the "
            "checkpoint it reads; give an output folder outside it"
        )
