"""The record of a Hugging Face export inside a save: which files of the checkpoint's
``huggingface/`` folder unickpt wrote (``unickpt.hf_export.json``, versioned JSON, no torch).

Written by rank 0 of the in-save export (``engine.export.hf.export_pieces`` with a
``manifest_save_id``): first, before any export file exists, naming every file the export will
write (``complete: false``, no sizes); then, once every file is written under its temporary
name and before any takes its final name, with each file's size (``complete: true``). Read
by ``folder.hf_files`` to tell unickpt's files from anyone else's before deleting them (a later
save at the same path, retention, ``unickpt prune``) and by ``unickpt ls``. A file counts as
unickpt's only when the manifest names it, it is a regular file (never a link) and it has its
recorded size; an incomplete record proves only the export's ``.unickpt-partial`` temporaries.

    {"format": "unickpt.hf_export", "version": 1, "save_id": "<the committed save it derives from>",
     "complete": true, "files": [["model-00001-of-00002.safetensors", 123456], ...]}

A manifest of another format, a newer version or malformed decodes to None: nothing in that
folder is then provably unickpt's, and nothing there is ever deleted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

__all__ = ["HF_FOLDER", "MANIFEST_FILE", "MANIFEST_LIMIT", "PARTIAL", "HFManifest", "is_export_file_name"]

HF_FOLDER = "huggingface"  # the subfolder of a checkpoint that ``SaveOptions.hf_export`` writes
MANIFEST_FILE = "unickpt.hf_export.json"
MANIFEST_LIMIT = 4 << 20  # bytes read of a manifest at most (tens of thousands of file names)
PARTIAL = ".unickpt-partial"  # the temporary suffix of every file the export writes
_FORMAT = "unickpt.hf_export"
_VERSION = 1
_MAX_FILES = 100_000
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def is_export_file_name(name: str) -> bool:
    """Whether ``name`` can be a file of an export: one plain name inside the folder, not the
    manifest, not a temporary."""
    return _NAME.fullmatch(name) is not None and name != MANIFEST_FILE and not name.endswith(PARTIAL)


@dataclass(frozen=True, slots=True)
class HFManifest:
    """What one in-save export wrote: ``files`` (name, size; size None while ``complete`` is
    False) for the committed save ``save_id`` ("" when unknown)."""

    save_id: str
    complete: bool
    files: tuple[tuple[str, int | None], ...]

    def encode(self) -> bytes:
        doc = {
            "format": _FORMAT,
            "version": _VERSION,
            "save_id": self.save_id,
            "complete": self.complete,
            "files": [[name, size] for name, size in self.files],
        }
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    @staticmethod
    def decode(data: bytes) -> HFManifest | None:
        """The manifest in ``data``, or None when it is not one this version writes."""
        try:
            doc = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError):
            return None
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("version") != _VERSION:
            return None
        save_id, complete, files = doc.get("save_id"), doc.get("complete"), doc.get("files")
        if not isinstance(save_id, str) or type(complete) is not bool or not isinstance(files, list):
            return None
        if len(files) > _MAX_FILES:
            return None
        out: list[tuple[str, int | None]] = []
        for entry in files:
            if not (isinstance(entry, list) and len(entry) == 2):
                return None
            name, size = entry
            if not isinstance(name, str) or not is_export_file_name(name):
                return None
            if size is not None and (type(size) is not int or size < 0):
                return None
            if size is None and complete:
                return None
            out.append((name, size))
        return HFManifest(save_id, complete, tuple(out))
