"""The data files a rank's read stage holds open, one handle a file (storages that read ahead).

``engine.load.reader.read_needs`` makes one ``OpenFiles`` for a storage whose
``capabilities.reads_ahead`` is set (local files through the page cache) and hands
``OpenFiles.stream`` to ``schedule.read_pieces``: the thread that reads a file's pieces front to
back holds ``stream(name)`` around them, which opens the file once (``Storage.open_reader``) and
closes it after the last piece (also after a failure). The runs of that file read through
``OpenFiles.read_into`` / ``read_into_cached``, which find the handle by name.

Why: a ``Storage.read_into`` call opens the file (a walk of its folders without following links,
a check that it is a regular file) and closes it again. The load reads in 1 MiB pieces
(``reader.FUSED``), so that was ~10 system calls a MiB, and each read came on a fresh open file,
where the kernel's read-ahead starts over (docs/performance.md, "One open file a stream").
Only one thread reads a file at a time here, and at most as many files are open as there are
reader threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ...storage import FileReader, Storage

__all__ = ["OpenFiles"]


class OpenFiles:
    """Handles on the files being read, by name (see the module docstring); ``close`` closes
    any a failed stream left (none when every stream ended)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._handles: dict[str, FileReader] = {}
        self._lock = threading.Lock()

    @contextmanager
    def stream(self, name: str) -> Iterator[None]:
        """Held by the one thread reading ``name``'s pieces: the file is open inside."""
        handle = self.storage.open_reader(name)
        with self._lock:
            self._handles[name] = handle
        try:
            yield
        finally:
            with self._lock:
                self._handles.pop(name, None)
            handle.close()

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._handles[name].read_into(offset, out)

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        self._handles[name].read_into_cached(offset, out)

    def close(self) -> None:
        with self._lock:
            left, self._handles = list(self._handles.values()), {}
        for handle in left:
            handle.close()
