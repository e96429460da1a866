"""Every save's per-rank phase records, kept inside the checkpoint (``SaveOptions.record_phases``,
on by default), so that ``unickpt report CKPT`` can tell after the fact which rank was slow in
which phase, without any sink having been added.

Order of use (one save):
  1. ``SavePipeline`` (every rank) wraps its checkpointer's bus in a ``RecordingBus``: each event
     of this save goes to the checkpointer's listeners as before and to the save's
     ``PhaseRecorder`` (a list append; nothing else is added to a save without listeners).
  2. ``engine.save.commit.commit_stage`` sends each rank's records so far (``PhaseRecorder.rows``)
     with its report to rank 0 (the commit barrier's payload: no extra round trip).
  3. rank 0, once the metadata is published, writes every rank's records (its own complete, the
     others' up to their report: what follows is waiting for rank 0) as one versioned JSON file,
     ``data/<save_id>/phases.json`` (``phases_name``), next to the save's data files: the save's
     data marker covers it (``folder.markers``), so it goes with the save's data. A failure to
     write it is a warning: the checkpoint is committed.
  4. ``read_phases(storage, save_id)`` (the report) reads it back, bounded and validated: the
     records in the shape ``monitoring.report`` takes (``JsonlSink``'s fields).

The file (version 1): ``{"format": "unickpt.phases", "version": 1, "save_id": ...,
"world_size": N, "ranks": [[row, ...] per rank]}``, each row ``[phase, start_unix, seconds,
bytes, path]`` (``path``: the file of a ``save.write.file`` row, else ""). At most
``MAX_ROWS_PER_RANK`` rows a rank are kept (the first ones); a few hundred bytes a row.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

from ..errors import CorruptMetadataError
from ..format.records import DATA_DIR
from ..storage.base import Storage
from .events import EventBus, Listener

__all__ = [
    "PHASES_FILE",
    "PHASES_FORMAT",
    "PHASES_VERSION",
    "MAX_ROWS_PER_RANK",
    "MAX_PHASES_BYTES",
    "PhaseRecorder",
    "RecordingBus",
    "phases_name",
    "encode_phases",
    "decode_phases",
    "read_phases",
]

PHASES_FILE = "phases.json"
PHASES_FORMAT = "unickpt.phases"
PHASES_VERSION = 1
MAX_ROWS_PER_RANK = 256
MAX_PHASES_BYTES = 64 << 20  # what a reader reads of the file at most
_CLOCK_OFFSET = time.time() - time.perf_counter()  # perf_counter -> wall clock (per process)
_SKIPPED = ("save.begin", "save.commit.begin")  # instants that carry no duration


def phases_name(save_id: str) -> str:
    """The file of a save's phase records, among its data files."""
    return f"{DATA_DIR}/{save_id}/{PHASES_FILE}"


class PhaseRecorder:
    """The phase records of one save on one rank (any thread may add)."""

    def __init__(self) -> None:
        self._rows: list[list[Any]] = []
        self._lock = threading.Lock()
        self.dropped = 0  # rows beyond MAX_ROWS_PER_RANK

    def add(self, phase: str, t_start: float, t_end: float, nbytes: int, path: str) -> None:
        if phase in _SKIPPED:
            return
        row = [phase, round(t_start + _CLOCK_OFFSET, 6), round(max(0.0, t_end - t_start), 6), int(nbytes), path]
        with self._lock:
            if len(self._rows) < MAX_ROWS_PER_RANK:
                self._rows.append(row)
            else:
                self.dropped += 1

    def rows(self) -> list[list[Any]]:
        with self._lock:
            return [list(r) for r in self._rows]


class RecordingBus(EventBus):
    """``inner`` (a checkpointer's bus) that also hands every event to ``recorder``: the bus one
    save's pipeline emits on. Listeners are the inner bus's."""

    def __init__(self, inner: EventBus, recorder: PhaseRecorder) -> None:
        super().__init__()
        self.inner, self.recorder = inner, recorder

    def add_listener(self, fn: Listener) -> None:
        self.inner.add_listener(fn)

    def remove_listener(self, fn: Listener) -> None:
        self.inner.remove_listener(fn)

    def clear(self) -> None:
        self.inner.clear()

    @property
    def listener_errors(self) -> int:  # type: ignore[override]
        return self.inner.listener_errors

    @listener_errors.setter
    def listener_errors(self, value: int) -> None:
        pass  # EventBus.__init__ sets it; the inner bus counts

    def emit(
        self, phase: str, rank: int, t_start: float | None = None, *, end: float | None = None, **fields: object
    ) -> None:
        now = time.perf_counter() if end is None else end
        start = now if t_start is None else t_start
        path = str(fields.get("path", "")) if phase.endswith(".file") else ""
        self.recorder.add(phase, start, now, int(fields.get("nbytes", 0) or 0), path)  # type: ignore[call-overload]
        self.inner.emit(phase, rank, start, end=now, **fields)


def encode_phases(save_id: str, ranks: list[list[list[Any]]]) -> bytes:
    """The file's bytes: every rank's rows, in rank order."""
    doc = {
        "format": PHASES_FORMAT,
        "version": PHASES_VERSION,
        "save_id": save_id,
        "world_size": len(ranks),
        "ranks": ranks,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def decode_phases(data: bytes, where: str) -> list[dict[str, Any]]:
    """The records of a phases file (``JsonlSink``'s fields: phase, rank, start_unix, seconds,
    bytes, path); ``CorruptMetadataError`` naming ``where`` for anything else."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptMetadataError(f"{where}: not a phase records file: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != PHASES_FORMAT:
        raise CorruptMetadataError(f"{where}: not a unickpt phase records file")
    if doc.get("version") != PHASES_VERSION:
        raise CorruptMetadataError(
            f"{where}: phase records of version {doc.get('version')!r}; this unickpt reads version {PHASES_VERSION}"
        )
    ranks = doc.get("ranks")
    if not isinstance(ranks, list):
        raise CorruptMetadataError(f"{where}: 'ranks' is not a list")
    save_id = str(doc.get("save_id", ""))
    out = []
    for rank, rows in enumerate(ranks):
        if not isinstance(rows, list) or len(rows) > MAX_ROWS_PER_RANK:
            raise CorruptMetadataError(f"{where}: the records of rank {rank} are not a list of at most "
                                       f"{MAX_ROWS_PER_RANK} rows")  # fmt: skip
        for row in rows:
            if not _is_row(row):
                raise CorruptMetadataError(f"{where}: malformed record of rank {rank}: {str(row)[:120]}")
            phase, start, seconds, nbytes, path = row
            out.append(
                {"phase": phase, "rank": rank, "start_unix": float(start), "seconds": float(seconds),
                 "bytes": int(nbytes), "path": path, "save_id": save_id}
            )  # fmt: skip
    return out


def _is_row(row: object) -> bool:
    if not (isinstance(row, list) and len(row) == 5):
        return False
    phase, start, seconds, nbytes, path = row
    numbers = all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (start, seconds)
    )
    return (
        isinstance(phase, str)
        and len(phase) <= 64
        and numbers
        and seconds >= 0
        and isinstance(nbytes, int)
        and not isinstance(nbytes, bool)
        and nbytes >= 0
        and isinstance(path, str)
        and len(path) <= 4096
    )


def read_phases(storage: Storage, save_id: str) -> list[dict[str, Any]] | None:
    """The phase records of save ``save_id`` at ``storage``; None when the checkpoint holds none
    (saved with ``SaveOptions(record_phases=False)`` or by an older unickpt)."""
    name = phases_name(save_id)
    data = storage.read(name, MAX_PHASES_BYTES)
    if data is None:
        return None
    return decode_phases(data, f"{storage.url}/{name}")
