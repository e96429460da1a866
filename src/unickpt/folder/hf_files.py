"""The files of a checkpoint's ``huggingface/`` folder that unickpt's in-save export wrote, and
deleting those only.

The export records what it writes in ``huggingface/unickpt.hf_export.json``
(``format.hf_manifest``). Callers, all on rank 0:
  ``Checkpointer`` before a save with ``hf_export`` (``hf_export_files``: anything not unickpt's
                 there refuses the save before it writes a byte) and after its commit, before
                 the export (``remove_hf_export``: the replaced checkpoint's export goes);
  the commit of every save (``engine.save.commit`` -> ``remove_stale_hf_export``): the export of
                 the checkpoint this save replaced describes a model that is no longer there;
  ``folder.cleanup.checkpoint_files`` (retention, ``unickpt prune``, ``delete_checkpoint``):
                 a deleted checkpoint's export goes with it;
  ``CheckpointManager`` for ``unickpt ls`` (``describe_hf_export``).
A name is unickpt's when the manifest is complete and names it, it is a regular file (a link is
never followed, nor deleted) and it has the size the manifest recorded; the export's
``.unickpt-partial`` temporaries of the names it lists and of the manifest are unickpt's too
(created exclusively under that name by the export, never by anyone else). While the record is
incomplete (``complete: false``: an export interrupted before its end) it proves those
temporaries only: the export writes its complete record before any file takes its final name
(``engine.export.hf``), so a file under a final name beside an incomplete record (a user's
``config.json`` or ``model.safetensors`` put there after the interruption) is not unickpt's.
Everything else in the folder (a user's file, a sub-folder, a link, the whole folder when it
is a link or a file) is *foreign*: never deleted, reported. Without a readable manifest of this
version nothing there is unickpt's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ..errors import CheckpointError
from ..format.hf_manifest import HF_FOLDER, MANIFEST_FILE, MANIFEST_LIMIT, PARTIAL, HFManifest
from ..storage.base import Storage

__all__ = ["HFExportFiles", "hf_export_files", "remove_hf_export", "remove_stale_hf_export", "describe_hf_export"]


@dataclass(frozen=True, slots=True)
class HFExportFiles:
    """What the ``huggingface/`` folder of one checkpoint holds (names relative to the storage's
    root): ``ours`` in the order to delete them (the manifest last), ``foreign`` the rest."""

    folder: str
    manifest: HFManifest | None
    ours: tuple[str, ...]
    foreign: tuple[str, ...]


def _regular_size(storage: Storage, name: str) -> int | None:
    """The size of the regular file ``name``; None for a link, a special file or a missing one."""
    try:
        return storage.size(name)
    except CheckpointError:  # a link or not a regular file: never unickpt's
        return None


def read_manifest(storage: Storage, name: str) -> HFManifest | None:
    """The manifest at ``name`` (a regular file, at most ``MANIFEST_LIMIT`` bytes), or None."""
    try:
        data = storage.read(name, MANIFEST_LIMIT)
    except CheckpointError:  # a link, a special file, too large: not provably unickpt's
        return None
    return None if data is None else HFManifest.decode(data)


def hf_export_files(storage: Storage, prefix: str = "", names: list[str] | None = None) -> HFExportFiles:
    """Sort the ``<prefix>huggingface`` folder's names (``names``: names under the root, listed
    when None) into unickpt's and foreign (module docstring). Reads the manifest and stats the
    files it names; deletes nothing."""
    folder = prefix + HF_FOLDER
    if names is None:
        names = storage.list(folder)
    inside = [n for n in names if n == folder or n.startswith(folder + "/")]
    manifest_name = f"{folder}/{MANIFEST_FILE}"
    manifest = read_manifest(storage, manifest_name) if manifest_name in inside else None
    listed = dict(manifest.files) if manifest is not None else {}
    ours: list[str] = []
    foreign: list[str] = []
    for n in inside:
        base = n[len(folder) + 1 :]
        if n == manifest_name and manifest is not None:
            continue  # added last
        if n == folder or "/" in base:  # the folder itself is a link or a file; a sub-folder's file
            foreign.append(n)
            continue
        stem = base[: -len(PARTIAL)] if base.endswith(PARTIAL) else None
        size = _regular_size(storage, n)
        if stem is not None:
            mine = size is not None and (stem == MANIFEST_FILE or stem in listed)
        else:
            want = listed.get(base, -1)  # None only in an incomplete record: then nothing is proven
            mine = size is not None and base in listed and want is not None and want == size
        (ours if mine else foreign).append(n)
    if manifest is not None:
        ours.append(manifest_name)
    return HFExportFiles(folder, manifest, tuple(ours), tuple(foreign))


def remove_hf_export(storage: Storage, prefix: str = "", names: list[str] | None = None) -> HFExportFiles:
    """Delete the files of ``<prefix>huggingface/`` that unickpt wrote, the manifest last (a
    crash half-way leaves it naming what is left); the folder goes when nothing else is in it.
    Returns what was found (``foreign``: what stays)."""
    found = hf_export_files(storage, prefix, names)
    if found.ours:
        manifest = f"{found.folder}/{MANIFEST_FILE}"
        files = [n for n in found.ours if n != manifest]
        if files:
            storage.delete(files)
        if found.manifest is not None:
            storage.delete([manifest])
    return found


def remove_stale_hf_export(storage: Storage) -> None:
    """Rank 0, right after a save committed at ``storage``: delete the export of the checkpoint it
    replaced (it describes another model; one listing when there is none), warning when files
    unickpt did not write stay in the folder."""
    if not storage.list(f"{HF_FOLDER}/{MANIFEST_FILE}"):
        return
    found = remove_hf_export(storage)
    if found.ours and found.foreign:
        warnings.warn(
            f"{storage.url}/{HF_FOLDER}: removed the Hugging Face export of the checkpoint this save replaced "
            f"({len(found.ours)} file(s) unickpt wrote); {len(found.foreign)} file(s) unickpt did not write stay "
            f"there, e.g. {list(found.foreign[:3])}",
            stacklevel=4,
        )


def describe_hf_export(storage: Storage, prefix: str, names: list[str], save_id: str | None) -> str:
    """A few words on the export in ``<prefix>huggingface/`` for ``unickpt ls``: "" when the
    names hold no manifest; else "hf export", "hf export (incomplete)" (the record is incomplete,
    or a file it names is not under its final name), or "hf export (stale: of save <id>)" when
    it derives from another save than the checkpoint's ``save_id``."""
    name = f"{prefix}{HF_FOLDER}/{MANIFEST_FILE}"
    if name not in names:
        return ""
    manifest = read_manifest(storage, name)
    if manifest is None:
        return "hf export (unreadable record)"
    if save_id is not None and manifest.save_id and manifest.save_id != save_id:
        return f"hf export (stale: of save {manifest.save_id})"
    present = set(names)
    folder = f"{prefix}{HF_FOLDER}/"
    whole = manifest.complete and all(folder + n in present for n, _ in manifest.files)  # all renamed
    return "hf export" if whole else "hf export (incomplete)"
