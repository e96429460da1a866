"""How the bytes of a checkpoint's data files are verified: CRC32C checksums of *units*, byte
ranges of one file, each with its checksum.

Two kinds, one question (``cover``):

- :class:`ChunkChecksums` (format version 3 on): every data file is cut into chunks of
  ``chunk_size`` bytes (the last one shorter) and each chunk has a CRC32C; the exact size of every
  file is recorded too. A reader that needs bytes ``[lo, hi)`` of a file reads the chunks that
  cover them (at most one partial chunk more on each side) and verifies each; so a rank that
  needs a part of a saved shard reads and verifies only that part (plus chunk edges), and the
  metadata holds 4 bytes per chunk whatever the number of tensors or shards.
- :class:`RangeChecksums` (format versions 1 and 2): one CRC32C per saved shard and per blob; a
  unit is the whole shard, so a reader needing any part of a shard reads and verifies all of it.
  Bytes between units (alignment padding) are covered by none.

Order of use: the writer (``engine.save.write``) computes chunk checksums with :func:`chunk_crcs`
while it writes; the coordinator (``format.build``) puts every rank's into one ``ChunkChecksums``
(``from_files``) in the metadata; the codec writes and reads it (``format.v3``; ``format.v1``
builds a ``RangeChecksums`` from its rows); the read engine and ``ops`` ask ``cover(file_index,
lo, hi)`` and check each unit's bytes against its checksum.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

__all__ = [
    "Units",
    "Checksums",
    "ChunkChecksums",
    "RangeChecksums",
    "chunk_crcs",
    "crc32c",
    "DEFAULT_CHUNK",
    "MIN_CHUNK",
    "MAX_CHUNK",
    "AUTO_MAX_CHUNKS",
    "auto_chunk",
    "is_chunk_size",
]

Buffer = bytes | bytearray | memoryview  # as storage.base.Buffer (format imports no other layer)

DEFAULT_CHUNK = 1 << 20  # the chunk of checkpoints up to AUTO_MAX_CHUNKS MiB (auto_chunk)
MIN_CHUNK = 4 << 10
MAX_CHUNK = 1 << 30
AUTO_MAX_CHUNKS = 1 << 21  # chunks (4 bytes of metadata each) an automatic chunk size keeps to


def is_chunk_size(value: object) -> bool:
    """Whether ``value`` is a checksum chunk size unickpt writes and reads: an int (not a bool)
    in [``MIN_CHUNK``, ``MAX_CHUNK``] (``SaveOptions``, the chunk a rank receives with its part
    of the save plan, the metadata's ``ChunkChecksums``)."""
    return type(value) is int and MIN_CHUNK <= value <= MAX_CHUNK


def auto_chunk(data_bytes: int, most: int | None = None) -> int:
    """The checksum chunk of a checkpoint of ``data_bytes`` when the save names none
    (``SaveOptions.checksum_chunk_bytes=None``; decided by the save's coordinator,
    ``engine.plan_cache.plan_stage``): ``DEFAULT_CHUNK``, doubled until the data is at most
    ``most`` chunks (2 Mi: 8 MiB of checksums in the metadata; 1 MiB chunks up to 2 TiB), and
    ``MAX_CHUNK`` at most (``most``: ``AUTO_MAX_CHUNKS`` when None). Reads verify whole chunks,
    so larger chunks only for larger data."""
    most = AUTO_MAX_CHUNKS if most is None else most
    chunk = DEFAULT_CHUNK
    while chunk < MAX_CHUNK and -(-max(0, data_bytes) // chunk) > most:
        chunk *= 2
    return chunk


@dataclass(frozen=True, slots=True)
class Units:
    """Units overlapping a queried byte range, in file order: unit i is bytes
    ``[starts[i], ends[i])`` with checksum ``crcs[i]``. ``lo``/``hi``: the range to read to verify
    them all (``starts[0]`` / ``ends[-1]``; the queried range itself when there is no unit)."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    crcs: tuple[int, ...]
    lo: int
    hi: int


class Checksums(Protocol):
    """What readers ask of a checkpoint's checksums."""

    def cover(self, file_index: int, lo: int, hi: int) -> Units:
        """The units overlapping bytes ``[lo, hi)`` of file ``file_index`` (none for an empty
        range)."""
        ...

    def file_size(self, file_index: int) -> int | None:
        """The file's size as written, when the metadata records it."""
        ...


@functools.cache
def _implementation() -> Callable[[Buffer, int], int]:
    from awscrt.checksums import crc32c as implementation

    return implementation


def preload() -> None:
    """Import the CRC32C implementation now. ``unickpt._preload`` calls it in a process that
    imported torch (a job), so that the first load of a restarted job does not pay for it:
    awscrt's import seeds its library's random generator from CPU jitter, 40-60 ms here."""
    _implementation()


def crc32c(data: Buffer, value: int = 0) -> int:
    """The CRC32C (Castagnoli) of ``data`` continuing ``value`` (the CRC of the bytes before it):
    the one implementation of every checksum unickpt writes or checks (the save's writers through
    :func:`chunk_crcs`, the read engine, ``ops.verify``, the RAM tier's copies).

    awscrt's ``aws-checksums``: carry-less-multiply folding (``PCLMULQDQ``, ``VPCLMULQDQ`` with
    AVX-512) where the CPU has it, the SSE4.2 ``crc32`` instruction or a table elsewhere; it
    releases the GIL, so reader threads check in parallel (docs/performance.md, "Checksums and
    round trips": 1.5x the ``crc32c`` package's throughput, ``bench/checksums.py``). Imported on
    first use: decoding metadata (``unickpt ls`` / ``inspect``) computes no CRC."""
    return _implementation()(data, value)


def chunk_crcs(parts: Iterable[Buffer], chunk_size: int) -> list[int]:
    """CRC32C of each ``chunk_size`` chunk of the concatenation of ``parts`` (the bytes of one
    data file, in order; the last chunk may be shorter; none for an empty file)."""
    out: list[int] = []
    crc, filled = 0, 0
    for part in parts:
        view = memoryview(part).cast("B")
        pos, n = 0, len(view)
        while pos < n:
            take = min(n - pos, chunk_size - filled)
            crc = crc32c(view[pos : pos + take], crc)
            filled += take
            pos += take
            if filled == chunk_size:
                out.append(crc)
                crc, filled = 0, 0
    if filled:
        out.append(crc)
    return out


def _chunks(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


@dataclass(frozen=True)
class ChunkChecksums:
    """CRC32C per ``chunk_size`` chunk of every data file (format version 3). ``crcs``: the
    little-endian uint32 checksums of file 0's chunks, then file 1's, ...; ``file_sizes``: each
    file's exact size. Consistency (counts, bounds) is checked by ``problems`` (the decoder)."""

    chunk_size: int
    file_sizes: tuple[int, ...]
    crcs: bytes
    _first: np.ndarray = field(init=False, repr=False, compare=False)  # index of each file's first chunk
    _crc: np.ndarray = field(init=False, repr=False, compare=False)
    _sizes: np.ndarray = field(init=False, repr=False, compare=False)  # file_sizes as an array

    def __post_init__(self) -> None:
        object.__setattr__(self, "_sizes", np.asarray(self.file_sizes, dtype=np.int64))
        counts = [_chunks(s, self.chunk_size) if self.chunk_size > 0 else 0 for s in self.file_sizes]
        object.__setattr__(self, "_first", np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]))
        object.__setattr__(self, "_crc", np.frombuffer(self.crcs, dtype="<u4"))

    @classmethod
    def from_files(cls, chunk_size: int, files: Sequence[tuple[int, Sequence[int]]]) -> ChunkChecksums:
        """From each file's ``(size, chunk checksums)``, in file-index order."""
        crcs = np.asarray([c for _, cs in files for c in cs], dtype="<u4").tobytes()
        return cls(chunk_size, tuple(int(s) for s, _ in files), crcs)

    def problems(self) -> list[str]:
        """Everything inconsistent (chunk size out of bounds, a checksum count that does not
        match the file sizes); empty when readers may use it."""
        if not is_chunk_size(self.chunk_size):
            return [f"checksum chunk size {self.chunk_size!r} is not in [{MIN_CHUNK}, {MAX_CHUNK}]"]
        if len(self.crcs) % 4:
            return ["chunk checksums are not whole 32-bit values"]
        want = int(self._first[-1])
        if want != len(self._crc):
            return [f"{len(self._crc)} chunk checksums for files that need {want} (chunk size {self.chunk_size})"]
        return []

    def file_size(self, file_index: int) -> int | None:
        return self.file_sizes[file_index]

    def file_crcs(self, file_index: int) -> list[int]:
        """Every chunk checksum of one file, in order."""
        a, b = int(self._first[file_index]), int(self._first[file_index + 1])
        return self._crc[a:b].tolist()

    def extent(self, file_index: int, lo: int, hi: int) -> tuple[int, int]:
        """``cover(...)``'s ``(lo, hi)`` alone: the bytes a verified read of ``[lo, hi)`` covers
        (what read assignments compare, for many shards: no unit list built)."""
        if hi <= lo:
            return lo, hi
        c = self.chunk_size
        return lo // c * c, min(_chunks(hi, c) * c, self.file_sizes[file_index])

    def extents(self, files: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``extent`` of many ranges at once (arrays of file indices and byte bounds): what a
        coordinator's read assignment over a whole job's needs compares."""
        c = self.chunk_size
        sizes = self._sizes[files]
        some = hi > lo
        return np.where(some, lo // c * c, lo), np.where(some, np.minimum(-(-hi // c) * c, sizes), hi)

    def cover(self, file_index: int, lo: int, hi: int) -> Units:
        if hi <= lo:
            return Units((), (), (), lo, hi)
        c, size = self.chunk_size, self.file_sizes[file_index]
        k0, k1 = lo // c, _chunks(hi, c)
        first = int(self._first[file_index])
        starts = tuple(range(k0 * c, k1 * c, c))
        ends = tuple(min(s + c, size) for s in starts)
        crcs = tuple(self._crc[first + k0 : first + k1].tolist())
        return Units(starts, ends, crcs, starts[0], ends[-1])


@dataclass(frozen=True)
class RangeChecksums:
    """One CRC32C per listed byte range (format versions 1 and 2: a saved shard or a blob each).
    ``units``: ``(file_index, byte_offset, byte_length, crc32c)``, no two overlapping (the
    decoder checks the ranges of every file)."""

    units: tuple[tuple[int, int, int, int], ...]
    _by_file: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(init=False, repr=False, compare=False)
    _exact: dict[tuple[int, int, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        grouped: dict[int, list[tuple[int, int, int]]] = {}
        for f, off, n, crc in self.units:
            if n:  # an empty range holds no byte to verify
                grouped.setdefault(f, []).append((off, off + n, crc))
        by_file = {}
        for f, rows in grouped.items():
            a = np.array(sorted(rows), dtype=np.int64).reshape(-1, 3)
            by_file[f] = (a[:, 0], a[:, 1], a[:, 2])
        object.__setattr__(self, "_by_file", by_file)
        object.__setattr__(self, "_exact", {(f, off, n): crc for f, off, n, crc in self.units})

    def crc_of(self, file_index: int, byte_offset: int, byte_length: int) -> int:
        """The checksum of exactly this range (KeyError when it is not a unit)."""
        return self._exact[(file_index, byte_offset, byte_length)]

    def file_size(self, file_index: int) -> int | None:
        return None

    def cover(self, file_index: int, lo: int, hi: int) -> Units:
        found = self._by_file.get(file_index)
        if hi <= lo or found is None:
            return Units((), (), (), lo, hi)
        starts, ends, crcs = found
        a = int(np.searchsorted(ends, lo, side="right"))  # first unit ending after lo
        b = int(np.searchsorted(starts, hi, side="left"))  # units starting before hi
        if a >= b:
            return Units((), (), (), lo, hi)
        s, e, c = (tuple(x[a:b].tolist()) for x in (starts, ends, crcs))
        return Units(s, e, c, min(lo, s[0]), max(hi, e[-1]))
