"""The read stage's clock: thread-seconds one rank's readers spend in read calls and in checksum
verification (``engine.load.reader`` adds, ``engine.load.stage`` emits them as monitoring's
``load.read.io`` and ``load.checksum``)."""

from __future__ import annotations

import threading

__all__ = ["ReadClock"]


class ReadClock:
    """Thread-seconds one rank's readers spent in read calls (``io``, with their bytes) and in
    checksum verification (``checksum``, with the bytes verified): monitoring's ``load.read.io``
    and ``load.checksum`` (``engine.load.stage`` emits them). Any reader thread adds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.io = self.checksum = 0.0
        self.io_bytes = self.checksum_bytes = 0
        self.first, self.last = float("inf"), 0.0

    def add_io(self, t0: float, t1: float, nbytes: int) -> None:
        self.add_folded(t0, t1, (t1 - t0, nbytes), (0.0, 0))

    def add_checksum(self, t0: float, t1: float, nbytes: int) -> None:
        with self._lock:
            self.checksum += t1 - t0
            self.checksum_bytes += nbytes

    def add_folded(self, t0: float, t1: float, io: tuple[float, int], checksum: tuple[float, int]) -> None:
        """A stretch read with its checksums folded in (``RunJob._read_folded``), from ``t0``
        to ``t1``: ``io`` and ``checksum`` are its (seconds, bytes) in read calls and in CRC32C."""
        with self._lock:
            self.io += io[0]
            self.io_bytes += io[1]
            self.checksum += checksum[0]
            self.checksum_bytes += checksum[1]
            self.first, self.last = min(self.first, t0), max(self.last, t1)
