"""The records ``unickpt report`` reads: the phase records a checkpoint keeps of its save
(``monitoring.phases``), or the ``rank<r>.jsonl`` files of a ``JsonlSink`` folder
(``monitoring.report.load_records``). ``monitoring.report`` builds the views from them."""

from __future__ import annotations

import os
from typing import Any

from ..monitoring.phases import read_phases
from ..monitoring.report import NoPhaseRecords, load_records
from .inspect import load_metadata

__all__ = ["checkpoint_records", "source_records"]


def checkpoint_records(path: str, role: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The phase records the checkpoint at ``path`` keeps of its save: (a title line, records).
    ``NoPhaseRecords`` when it keeps none; the errors of ``ops.inspect.load_metadata`` when
    ``path`` is no readable checkpoint."""
    storage, md, _ = load_metadata(path, role)
    records = read_phases(storage, md.save_id)
    if not records:
        raise NoPhaseRecords(
            f"{storage.url}: no phase records in this checkpoint (save {md.save_id}); they are kept by "
            "default since this unickpt version, unless saved with SaveOptions(record_phases=False)"
        )
    ranks = len({int(r["rank"]) for r in records})
    return f"phases of save {md.save_id} at {storage.url} ({ranks} rank(s), kept in the checkpoint)", records


def source_records(path: str, role: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """A folder of ``rank<r>.jsonl`` files (``JsonlSink``) or a checkpoint: (title, records)."""
    if role is None and os.path.isdir(path):
        if any(n.startswith("rank") and n.endswith(".jsonl") for n in os.listdir(path)):
            return f"metrics in {path}", load_records(path)
    return checkpoint_records(path, role)
