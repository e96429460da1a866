"""What a checkpoint folder holds: its committed metadata, and what it is when it holds none.

The one way to read a folder's committed metadata: through its publisher (``folder.publish``,
which finds a version moved aside by an interrupted publication), bounded by ``limit`` bytes.
  ``read_committed``      the raw bytes, or None (nothing committed);
  ``committed_metadata``  those bytes decoded (None: nothing committed; a ``CheckpointError``
                          when they cannot be read or decoded);
  ``committed_save_id``   only the save id (None: none, or unreadable), for the commit (which
                          save it replaces), the lock (did this save commit?) and loads (was the
                          checkpoint re-committed meanwhile?);
  ``read_metadata_bytes`` for loads and ``ops``: a folder without metadata is told apart as
                          an interrupted save (``IncompleteCheckpointError``: unickpt's lock,
                          marker or data files, the word and reason ``unickpt ls`` prints)
                          or not a checkpoint (``NotACheckpointError``, with ``folder_hint``'s
                          sentence saying what the folder is instead).
``folder_hint`` runs only on that error path, so its listings cost nothing on a real load: it
recognises a PyTorch DCP checkpoint (a ``.metadata`` file beside ``__<rank>_<n>.distcp`` files)
a ``CheckpointManager`` root (``step_<n>`` folders) and checkpoints in sub-folders (an HF
Trainer's ``checkpoint-8/unickpt``); "" for anything else.
"""

from __future__ import annotations

import json
import os
import re

from ..errors import CheckpointError, IncompleteCheckpointError, NotACheckpointError, SizeLimitError
from ..format.codec import decode_metadata
from ..format.records import DATA_DIR, METADATA_FILE, Metadata
from ..storage import absence
from ..storage.base import METADATA_LIMIT, Storage
from .markers import is_unickpt_name
from .publish import publisher_for

__all__ = ["read_committed", "committed_metadata", "committed_save_id", "read_metadata_bytes", "folder_hint"]

UNFINISHED = "no metadata: a save in progress or interrupted"  # why a folder is incomplete (``folder.state``)
_DISTCP = re.compile(r"__\d+_\d+\.distcp")
_STEP = re.compile(r"step_(\d{8,})")
SEARCH_DEPTH = 4  # folder levels searched below (``folder.state.MAX_DEPTH``)


def read_committed(storage: Storage, prefix: str = "", limit: int = METADATA_LIMIT) -> bytes | None:
    """The committed metadata bytes of the checkpoint at ``prefix`` in ``storage`` (None: nothing
    committed); at most ``limit`` bytes of a regular file (``SizeLimitError`` / ``UnsafePathError``)."""
    return publisher_for(storage).read(prefix + METADATA_FILE, limit)


def committed_metadata(
    storage: Storage, prefix: str = "", limit: int = METADATA_LIMIT, where: str | None = None
) -> Metadata | None:
    """The decoded committed metadata at ``prefix`` (None: nothing committed). Raises a
    ``CheckpointError`` when it cannot be read or decoded (a newer format, corrupt, too large, a
    link); ``where``: the file's name in its message (default: its URL)."""
    data = read_committed(storage, prefix, limit)
    where = where if where is not None else f"{storage.url}/{prefix}{METADATA_FILE}"
    return None if data is None else decode_metadata(data, where)


def committed_save_id(storage: Storage) -> str | None:
    """The save id of the checkpoint committed at ``storage`` now, or None (none / unreadable)."""
    try:
        data = read_committed(storage)
        doc = json.loads(data.decode("utf-8")) if data is not None else None
    except (CheckpointError, ValueError, UnicodeDecodeError):
        return None
    sid = doc.get("save_id") if isinstance(doc, dict) else None
    return sid if isinstance(sid, str) else None


def read_metadata_bytes(storage: Storage, limit: int = METADATA_LIMIT) -> bytes:
    """The raw metadata bytes of the checkpoint in ``storage`` (one process, no collective).

    A missing metadata file is told apart: data files present -> IncompleteCheckpointError (an
    interrupted save), nothing -> NotACheckpointError. Only a regular file of at most ``limit``
    bytes is read (``SizeLimitError`` / ``UnsafePathError``). Used by ``engine.read.read_metadata``
    and ``ops``."""
    try:
        data = read_committed(storage, limit=limit)
    except SizeLimitError as e:
        raise SizeLimitError(
            f"{e} (the metadata cap: LoadOptions(limits=LoadLimits(max_metadata_bytes=...)) raises it for a "
            "larger checkpoint)"
        ) from None
    if data is not None:
        return data
    publisher = publisher_for(storage)
    if any(is_unickpt_name(n, publisher) for n in storage.list("unickpt.") if "/" not in n):
        raise IncompleteCheckpointError(  # the word and reason `unickpt ls` prints (``folder.state``)
            f"{storage.url} is incomplete ({UNFINISHED}): {METADATA_FILE} was never committed, so it "
            "cannot be loaded; a later save at this path replaces it"
        )
    if storage.list(DATA_DIR + "/"):
        raise IncompleteCheckpointError(
            f"{storage.url} is incomplete (no metadata: data files of an interrupted save, no record of "
            f"which): {METADATA_FILE} was never committed, so it cannot be loaded"
        )
    missing = absence(storage)
    if missing is not None:
        raise NotACheckpointError(f"no checkpoint at {storage.url} ({missing})")
    raise NotACheckpointError(f"{storage.url} is not a unickpt checkpoint (no {METADATA_FILE}){folder_hint(storage)}")


def _is_local_file(storage: Storage) -> bool:
    from ..storage import unwrap
    from ..storage.local import LocalStorage

    inner = unwrap(storage)
    return isinstance(inner, LocalStorage) and os.path.isfile(inner.root)


def folder_hint(storage: Storage) -> str:
    """A sentence saying what ``storage`` holds and how to load it, or "" (also when the folder
    cannot be listed: the hint never replaces the error it decorates)."""
    if _is_local_file(storage):
        return (
            "; it is a file, and a unickpt checkpoint is a folder: a torch.save file or a Lightning .ckpt imports "
            "once with `unickpt convert --from torch|lightning FILE OUT` (docs/migrating.md); then load OUT"
        )
    try:
        names = storage.list("")
    except (CheckpointError, OSError):
        return ""
    top = [n for n in names if "/" not in n]
    if ".metadata" in top and any(_DISTCP.fullmatch(n) for n in top):
        return (
            "; it is a PyTorch DCP (torch.distributed.checkpoint) checkpoint: load it with "
            "torch.distributed.checkpoint.load, or convert it once with `unickpt convert` and load the result"
        )
    steps: dict[int, str] = {}
    for name in names:
        folder = name.split("/", 1)[0]
        m = _STEP.fullmatch(folder)
        if m and name.endswith("/" + METADATA_FILE):
            steps.setdefault(int(m.group(1)), folder)
    if not steps:
        return _below_hint(storage.url, names)
    shown = [steps[s] for s in sorted(steps)]
    listed = ", ".join(shown[-10:]) + (f" (and {len(shown) - 10} older)" if len(shown) > 10 else "")
    newest = f"{storage.url.rstrip('/')}/{shown[-1]}"
    return (
        f"; it is a CheckpointManager root holding {listed}: resume with "
        f"unickpt.CheckpointManager({storage.url!r}).load_latest(state), or load the newest step {newest}"
    )


def _below_hint(url: str, names: list[str]) -> str:
    """The hint for a folder with unickpt checkpoints in sub-folders (an HF Trainer's
    ``checkpoint-8`` holding ``unickpt/``, a Lightning ``dirpath``), or ""."""
    tail = "/" + METADATA_FILE
    below = sorted({n[: -len(tail)] for n in names if n.endswith(tail) and n.count("/") <= SEARCH_DEPTH})
    if not below:
        return ""
    base = url.rstrip("/")
    shown = ", ".join(f"{base}/{b}" for b in below[:5]) + (f" (and {len(below) - 5} more)" if len(below) > 5 else "")
    return f"; unickpt checkpoint(s) below it: {shown}: pass that path (`unickpt ls {base}` lists them all)"
