"""``unickpt verify`` (and ``inspect --verify``): read every byte the metadata names and check
every checksum, reporting each problem instead of raising.

Used by ``unickpt verify`` / ``inspect --verify`` and for tiering's copies
(``tiering.copy_checkpoint``), after the metadata is decoded. The decoder has already checked
completeness (every tensor tiled by its shards, every range inside its file's recorded size);
``verify`` checks what only the bytes can tell. Per data file, in parallel: missing, or of another
size than the rule of ``folder.files`` allows (missing, not a regular file, short: a failure; longer
than recorded: complete, with a note in ``VerifyReport.notes``), then every checksum unit (``format.checksums``:
each file chunk from version 3, each shard and blob before) streamed through one reusable buffer
per thread, consecutive units read together; a unit larger than the buffer is checksummed piece by
piece. Memory stays at ``batch_bytes`` whatever sizes the metadata claims. A bad unit is reported
with the tensors and blobs whose bytes it holds.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import CheckpointError, ChecksumMismatchError, MissingDataFileError, TruncatedDataFileError
from ..folder.files import LONGER, MISSING, NOT_A_FILE, data_files, from_sizes, stat_sizes
from ..format import Metadata
from ..format.checksums import Units, crc32c
from ..storage import Storage

__all__ = ["VerifyReport", "verify", "file_sizes"]

_BATCH_BYTES = 64 << 20


@dataclass(slots=True)
class VerifyReport:
    ok: bool
    shards_checked: int
    blobs_checked: int
    bytes_checked: int
    seconds: float
    failures: list[str] = field(default_factory=list)  # the first failures, in file order
    failures_total: int = 0
    notes: list[str] = field(default_factory=list)  # not failures: e.g. a file longer than recorded


@dataclass(frozen=True, slots=True)
class _Held:
    """A tensor shard or blob's bytes ``[lo, hi)`` in one file."""

    lo: int
    hi: int
    what: str
    blob: bool


def _holdings(md: Metadata) -> dict[int, list[_Held]]:
    out: dict[int, list[_Held]] = {}
    for fqn, rec in md.tensors.items():
        for s in rec.shards:
            what = f"{fqn!r} shard offsets={s.offsets} lengths={s.lengths}"
            out.setdefault(s.file_index, []).append(_Held(s.byte_offset, s.byte_offset + s.byte_length, what, False))
    for b in md.blobs.values():
        blob = _Held(b.byte_offset, b.byte_offset + b.byte_length, f"blob {b.key!r}", True)
        out.setdefault(b.file_index, []).append(blob)
    for held in out.values():
        held.sort(key=lambda h: (h.lo, h.hi))
    return out


def file_sizes(storage: Storage, md: Metadata, threads: int = 16) -> dict[str, int | None]:
    """Size on storage of every data file named by ``md`` (None: missing); stats only, through
    ``folder.files``' pool; a name the storage refuses (a link) raises its error."""
    out: dict[str, int | None] = {}
    for name, stat in zip(md.files, stat_sizes(storage, md.files, threads)):
        if isinstance(stat, CheckpointError):
            raise stat
        out[name] = stat
    return out


def verify(
    md: Metadata,
    storage: Storage,
    *,
    sizes: dict[str, int | None] | None = None,
    threads: int = 4,
    max_failures: int = 10,
    batch_bytes: int = _BATCH_BYTES,
) -> VerifyReport:
    """Check every data file and every checksum of ``md``; never raises for a bad file, reports
    it (up to ``max_failures`` messages, all counted). ``sizes``: ``file_sizes``' result when the
    caller has it (else each file is stat'ed here, and a link in a file's place is reported)."""
    crc32c(b"")  # its library loaded before the clock starts (``_check_units`` uses it)
    t0 = time.perf_counter()
    found = data_files(storage, md) if sizes is None else from_sizes(md, sizes)
    notes = [f.describe(storage.url) for f in found if f.state == LONGER]
    held = _holdings(md)
    lock = threading.Lock()
    failures: list[tuple[int, int, str]] = []  # (file, byte, message): sorted at the end
    bad: dict[int, list[tuple[int, int]]] = {}  # file -> byte ranges that failed
    buffer = max(1 << 16, batch_bytes // max(1, threads))

    def fail(f: int, at: int, message: str, lo: int = 0, hi: int = 1 << 62) -> None:
        with lock:
            failures.append((f, at, message))
            bad.setdefault(f, []).append((lo, hi))

    def check_file(f: int) -> None:
        name = md.files[f]
        mine = held.get(f, [])
        state = found[f]
        size = state.size
        if state.state in (MISSING, NOT_A_FILE) or size is None:
            error = MissingDataFileError.__name__ if state.state == MISSING else type(state.refused).__name__
            fail(
                f,
                0,
                f"{error}: {state.describe(storage.url)} "
                f"(it holds {len(mine)} tensor shards/blobs, e.g. {[h.what for h in mine[:3]]})",
            )
            return
        recorded = md.checksums.file_size(f) if md.checksums is not None else None
        end = max([state.expected, *(h.hi for h in mine)])
        if not state.complete:
            lost = [h.what for h in mine if h.hi > size]
            fail(
                f,
                size,
                f"{TruncatedDataFileError.__name__}: {state.describe(storage.url, recorded is not None)}"
                + (f"; the missing bytes held {_named(lost)}" if lost else ""),
                size,
            )
        if md.checksums is None:
            return
        units = md.checksums.cover(f, 0, min(size, end))
        whole = [i for i, e in enumerate(units.ends) if e <= size]  # units cut short: reported above
        starts, ends, crcs = (tuple(x[i] for i in whole) for x in (units.starts, units.ends, units.crcs))
        units = Units(starts, ends, crcs, units.lo, units.hi)
        _check_units(storage, name, units, buffer, lambda lo, hi, msg: fail(f, lo, msg, lo, hi), mine)

    with ThreadPoolExecutor(max(1, min(threads, len(md.files) or 1)), thread_name_prefix="unickpt-verify") as pool:
        for fut in [pool.submit(check_file, f) for f in range(len(md.files))]:
            fut.result()

    report = VerifyReport(ok=not failures, shards_checked=0, blobs_checked=0, bytes_checked=0, seconds=0.0)
    for f, items in held.items():
        ranges = sorted(bad.get(f, []))
        for h in items:
            if any(lo < max(h.hi, h.lo + 1) and h.lo < hi for lo, hi in ranges):
                continue
            if h.blob:
                report.blobs_checked += 1
            else:
                report.shards_checked += 1
            report.bytes_checked += h.hi - h.lo
    failures.sort(key=lambda t: (t[0], t[1]))
    report.failures = [m for _, _, m in failures[:max_failures]]
    report.failures_total = len(failures)
    report.notes = notes
    report.seconds = time.perf_counter() - t0
    return report


def _named(things: list[str], cap: int = 8) -> str:
    return ", ".join(things[:cap]) + (f" and {len(things) - cap} more" if len(things) > cap else "")


def _check_units(
    storage: Storage,
    name: str,
    units: Units,
    buffer: int,
    fail: Callable[[int, int, str], None],
    held: list[_Held],
) -> None:
    """Read the units of one file in order, consecutive ones together, and check each."""
    buf = bytearray(min(buffer, max(1, units.hi - units.lo)))
    view = memoryview(buf)
    starts = [h.lo for h in held]
    i, n = 0, len(units.starts)
    while i < n:
        lo = units.starts[i]
        j = i
        while j + 1 < n and units.starts[j + 1] == units.ends[j] and units.ends[j + 1] - lo <= len(buf):
            j += 1
        hi = units.ends[j]
        try:
            if hi - lo <= len(buf):
                storage.read_into(name, lo, view[: hi - lo])
                spans = zip(units.starts[i : j + 1], units.ends[i : j + 1])
                got = [crc32c(view[a - lo : b - lo]) for a, b in spans]
            else:  # one unit larger than the buffer: checksummed piece by piece
                crc, pos = 0, lo
                while pos < hi:
                    k = min(len(buf), hi - pos)
                    storage.read_into(name, pos, view[:k])
                    crc = crc32c(view[:k], crc)
                    pos += k
                got = [crc]
        except CheckpointError as e:
            fail(lo, hi, f"{type(e).__name__}: {e}")
            i = j + 1
            continue
        for k, crc in zip(range(i, j + 1), got):
            a, b, want = units.starts[k], units.ends[k], units.crcs[k]
            if crc != want:
                first = bisect.bisect_left(starts, b)
                holders = [h.what for h in held[:first] if h.hi > a or (h.lo == h.hi and h.lo >= a)]
                fail(
                    a,
                    b,
                    f"{ChecksumMismatchError.__name__}: checksum mismatch in {storage.url}/{name} bytes [{a}, {b}) "
                    f"(holding {_named(holders) or 'no tensor'}): stored {want:#010x}, read {crc:#010x}",
                )
        i = j + 1
