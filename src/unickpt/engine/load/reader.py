"""Executing one rank's reads: runs of bytes read in parallel, verified unit by unit, and each
need placed as soon as the units covering it are verified.

``engine.load.stage.read_stage`` turns the saved shards a rank reads into ``Need``s (a byte
range of a data file and where it lands) and calls ``read_needs``: small neighbouring needs
grouped (``_group_small``), the needs' spans grouped into runs
(``planning.load.runs.plan_runs``), the files checked (``_check_files``), every run handed to a
``RunJob`` and the pieces of all runs read by the reader threads (``engine.load.schedule``:
one thread per file at a time on local files, one pool over all pieces elsewhere).

A run's bytes land, piece by piece, in *segments*: the
destination memory itself for a need that has one contiguous destination (``Need.dest``: a live
tensor, or the buffer a batch is forwarded from), and temporaries for everything else (small
tensors read together, parts of shards that are copied elsewhere, chunk edges). Pieces are cut
at 16 MiB lines of file offset and read by the readers in any order; the thread finishing
the last piece of a checksum unit verifies it, and the thread verifying the last unit of a need
hands it on: the bytes of small tensors with contiguous destinations (``Need.into``) are
copied there as plain bytes, in a batch with the others that unit completes; any other need is
handed to ``Need.done`` (copies into place). Temporaries are allocated when their first piece
starts and dropped when their last need is done, so memory stays near the bytes in flight.
A need with a contiguous CUDA destination (``Need.device``) gets one segment per piece instead,
each read into a bounce buffer of ``engine.load.device.DeviceCopies`` and copied to its place on
the device once every unit overlapping it is verified (``_release``).
"""

from __future__ import annotations

import bisect
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ...errors import ChecksumMismatchError
from ...folder.files import data_files, raise_problem
from ...format.checksums import Units, crc32c
from ...format.records import Metadata
from ...planning.load.runs import MERGE_GAP, Run, Span, cover_of, extent_of, plan_runs
from ...storage.base import Storage
from ..bytes_view import tensor_bytes
from .clock import ReadClock
from .device import Bounce, DeviceCopies
from .schedule import ReaderThreads, read_pieces

__all__ = ["Need", "RunJob", "ReadClock", "PIECE", "read_needs"]

Copied = Callable[[float, float, int], None]  # (start, end, bytes) of a batch of copies into place


PIECE = 16 << 20  # runs are read as parallel ranged reads cut at multiples of this file offset
# local files: reads of this many bytes, each folded into its unit's CRC32C right after it lands,
# while its bytes are still in the core's L2 cache (docs/performance.md, "Load from RAM": 1 MiB
# pieces cost less CPU than 4 MiB ones, whose bytes the CRC read back from L3 or memory)
FUSED = 1 << 20


@dataclass(eq=False)
class Need:
    """Bytes ``[lo, hi)`` of file ``name`` that this rank reads; ``dest``: where they land when
    they have one contiguous destination (exactly ``hi - lo`` bytes), else a temporary; ``into``:
    for a need read into a temporary, contiguous destinations the run copies bytes into itself
    once every unit covering ``[lo, hi)`` is verified, as ``(file offset, byte view)`` pairs
    inside ``[lo, hi)`` (small tensors read with their neighbours: one need may serve several);
    ``done`` (if any): called with the bytes (a uint8 tensor) after that; ``what``: names the
    need in errors (the tensor, the blob); ``device``: a CUDA destination region its bytes are
    copied to piece by piece through bounce buffers (``engine.load.device``) when the run has a
    ``DeviceCopies`` and no other need overlaps it; else ``done`` places them."""

    name: str
    lo: int
    hi: int
    done: Callable[[torch.Tensor], None] | None
    what: str
    dest: torch.Tensor | None = None
    into: tuple[tuple[int, memoryview], ...] = ()
    device: torch.Tensor | None = None  # a CUDA destination region (uint8, hi - lo bytes): bounced
    left: int = 0  # units still to verify (set by RunJob)
    segment: _Segment | None = field(default=None, repr=False)
    bounced: bool = False  # set by RunJob: its bytes go to ``device`` piece by piece, ``done`` unused


@dataclass(eq=False)
class _Segment:
    """A stretch of the run and the memory its bytes land in: a need's destination, or a
    temporary (``memory`` None until a piece allocates it). ``pending``: needs in it not done
    yet, units overlapping it not verified yet and pieces into it not read yet; a temporary is
    freed when it reaches zero."""

    lo: int
    hi: int
    memory: torch.Tensor | None
    view: memoryview | None = None
    direct: bool = False
    pending: int = 0
    device: torch.Tensor | None = None  # a bounced segment: its bytes' place on the device
    bounce: Bounce | None = None  # its host memory while read and verified


class RunJob:
    """One run of one file: ``pieces()`` are read by the pool (``read_piece``), in any order and
    in parallel; ``verify``: check the checksums (else units are only counted); ``copied``
    (monitoring): told ``(start, end, bytes)`` of each batch of copies into ``Need.into``."""

    def __init__(
        self,
        run: Run,
        name: str,
        needs: Sequence[Need],
        units: Units,
        read_into: Callable[[str, int, memoryview], None],
        verify: bool,
        source: str,
        rank: int,
        holders: Callable[[int, int], list[str]] | None = None,
        piece: int = PIECE,
        copied: Callable[[float, float, int], None] | None = None,
        clock: ReadClock | None = None,
        device: DeviceCopies | None = None,
        fused: int = 0,
    ) -> None:
        self.run, self.name, self.needs, self.units = run, name, list(needs), units
        self.device = device
        self.read_into, self.verify, self.source, self.rank = read_into, verify, source, rank
        self.holders = holders  # what bytes [lo, hi) of the file hold (for errors)
        self.piece = piece
        self.copied = copied
        self.clock = clock if clock is not None else ReadClock()
        self._lock = threading.Lock()
        self.segments = self._segments()
        self._seg_starts = [s.lo for s in self.segments]
        self._seg_ends = [s.hi for s in self.segments]
        self._pieces = self._cut()
        # what each piece completes: units still waiting for pieces, and needs no unit covers
        # (unverified reads) still waiting for pieces; what each unit completes: needs
        self._unit_left = [0] * len(units.starts)
        self._unit_needs: list[list[Need]] = [[] for _ in units.starts]
        self._piece_needs: list[list[Need]] = [[] for _ in self._pieces]
        for lo, hi in self._pieces:
            for u in self._units_in(lo, hi):
                self._unit_left[u] += 1
        for need in self.needs:
            for u in self._units_in(need.lo, need.hi):
                self._unit_needs[u].append(need)
                need.left += 1
            if need.left == 0 and need.hi > need.lo:
                for p, (lo, hi) in enumerate(self._pieces):
                    if lo < need.hi and need.lo < hi:
                        self._piece_needs[p].append(need)
                        need.left += 1
        for seg in self.segments:
            seg.pending += len(self._units_in(seg.lo, seg.hi))
        for lo, hi in self._pieces:  # a piece still to read into a segment holds it too
            for seg in self._segments_in(lo, hi):
                seg.pending += 1
        self.nbytes = run.hi - run.lo
        # fused checksums (``fused`` > 0, with ``verify``): host-memory reads are cut into reads of
        # ``fused`` bytes and each is folded into the CRC32C of its unit right away, while its
        # bytes are still in the core's cache (``_read_folded``); a unit whose bytes all arrived
        # in file order is then checked without reading its memory again (``_check``)
        self.fused = fused if verify else 0
        self._unit_crc = [0] * len(units.starts)
        self._unit_next = list(units.starts)  # the next offset the unit's running CRC expects (-1: broken)

    # ------------------------------------------------------------------ layout

    def _segments(self) -> list[_Segment]:
        """Direct destinations where needs have them; temporaries over every other stretch, cut
        between needs once they reach ``PIECE`` bytes (so a temporary is freed while later parts
        of a long run are still being read)."""
        out: list[_Segment] = []
        pos = end = self.run.lo  # start of the open temporary; end of the needs so far
        ordered = sorted(self.needs, key=lambda n: (n.lo, n.hi))
        for i, need in enumerate(ordered):
            if need.hi <= need.lo:
                continue
            alone = need.lo >= end  # overlaps no earlier need
            if need.device is not None and self.device is not None and alone and _clear_after(ordered, i):
                if need.lo > pos:
                    out.append(_Segment(pos, need.lo, None))
                out += self._bounced(need)
                need.bounced = True
                pos = end = need.hi
                continue
            if need.dest is not None and alone:
                if need.lo > pos:
                    out.append(_Segment(pos, need.lo, None))
                out.append(_Segment(need.lo, need.hi, need.dest, tensor_bytes(need.dest), direct=True))
                pos = need.hi
            elif alone and need.lo - pos >= self.piece:
                out.append(_Segment(pos, need.lo, None))
                pos = need.lo
            end = max(end, need.hi)
        if pos < self.run.hi:
            out.append(_Segment(pos, self.run.hi, None))
        starts = [s.lo for s in out]
        for need in self.needs:
            if need.hi > need.lo and not need.bounced:
                need.segment = out[bisect.bisect_right(starts, need.lo) - 1]
                need.segment.pending += 1
        return out

    def _bounced(self, need: Need) -> list[_Segment]:
        """A bounced need's segments: one per piece it overlaps (cut at the pieces' lines), each
        read into a bounce buffer and copied to its part of ``need.device``."""
        assert need.device is not None
        out = []
        lo = need.lo
        while lo < need.hi:
            hi = min(need.hi, (lo // self.piece + 1) * self.piece)
            out.append(_Segment(lo, hi, None, device=need.device[lo - need.lo : hi - need.lo]))
            lo = hi
        return out

    def _cut(self) -> list[tuple[int, int]]:
        lo, hi = self.run.lo, self.run.hi
        out = []
        while lo < hi:
            nxt = min(hi, (lo // self.piece + 1) * self.piece)
            out.append((lo, nxt))
            lo = nxt
        return out

    def _units_in(self, lo: int, hi: int) -> range:
        """Indices of the units overlapping ``[lo, hi)`` (units are sorted and disjoint)."""
        a = bisect.bisect_right(self.units.ends, lo)
        return range(a, max(a, bisect.bisect_left(self.units.starts, hi)))

    def _segments_in(self, lo: int, hi: int) -> list[_Segment]:
        """The segments overlapping ``[lo, hi)`` (segments tile the run in order)."""
        a = bisect.bisect_right(self._seg_ends, lo)
        b = bisect.bisect_left(self._seg_starts, hi)
        return self.segments[a:b]

    def pieces(self) -> list[tuple[int, int]]:
        """The run's pieces: ``read_piece(i)`` reads ``pieces()[i]``."""
        return list(self._pieces)

    # ------------------------------------------------------------------ reading

    def _memory(self, seg: _Segment) -> memoryview:
        if seg.device is not None:  # one piece reads a bounced segment: no other thread touches it
            assert self.device is not None
            if seg.view is None:
                seg.bounce = self.device.acquire(seg.hi - seg.lo)
                seg.memory = seg.bounce.memory
                seg.view = tensor_bytes(seg.memory)
            return seg.view
        with self._lock:
            if seg.view is None:  # the first piece into a temporary allocates it
                seg.memory = torch.empty(seg.hi - seg.lo, dtype=torch.uint8)
                seg.view = tensor_bytes(seg.memory)
            return seg.view

    def read_piece(self, p: int) -> None:
        """Read piece ``p`` of the run into its segments; then verify the units it completed
        and hand on the needs they (or it) completed (``read_bytes`` then ``settle``)."""
        self.read_bytes(p)
        self.settle(p)

    def read_bytes(self, p: int) -> None:
        """Only read piece ``p`` into its segments (``settle(p)`` must follow, on any thread,
        before the run's units it completes are verified)."""
        lo, hi = self._pieces[p]
        for seg in self._segments_in(lo, hi):
            a, b = max(lo, seg.lo), min(hi, seg.hi)
            memory = self._memory(seg)
            if self.fused and seg.device is None:
                self._read_folded(a, b, seg.lo, memory)
                continue
            t0 = time.perf_counter()
            self.read_into(self.name, a, memory[a - seg.lo : b - seg.lo])
            self.clock.add_io(t0, time.perf_counter(), b - a)

    def _read_folded(self, a: int, b: int, base: int, memory: memoryview) -> None:
        """Read bytes ``[a, b)`` of the file (landing at ``memory[x - base]``) in reads of
        ``fused`` bytes, each folded into its unit's running CRC32C right after it lands. Only
        the thread that finds a unit expecting exactly its offset (``_unit_next``) folds it,
        marking it -2 meanwhile; one that reaches a unit out of order marks it -1, and such a
        unit is checked whole once read (``_check``). Bytes outside every unit are only read."""
        read, starts, ends, step = self.read_into, self.units.starts, self.units.ends, self.fused
        t_first = time.perf_counter()
        io = crc_s = 0.0
        folded = 0
        x = a
        for u in self._units_in(a, b):
            ua, ub = max(a, starts[u]), min(b, ends[u])
            if x < ua:  # bytes before this unit
                t0 = time.perf_counter()
                read(self.name, x, memory[x - base : ua - base])
                io += time.perf_counter() - t0
            with self._lock:
                mine = self._unit_next[u] == ua
                self._unit_next[u] = -2 if mine else -1
                crc = self._unit_crc[u]
            y = ua
            while y < ub:
                z = min(ub, (y // step + 1) * step)
                view = memory[y - base : z - base]
                t0 = time.perf_counter()
                read(self.name, y, view)
                t1 = time.perf_counter()
                io += t1 - t0
                if mine:
                    crc = crc32c(view, crc)
                    crc_s += time.perf_counter() - t1
                y = z
            if mine:
                folded += ub - ua
                with self._lock:
                    if self._unit_next[u] == -2:  # nobody reached it out of order meanwhile
                        self._unit_crc[u], self._unit_next[u] = crc, ub
            x = ub
        if x < b:  # bytes after the last unit
            t0 = time.perf_counter()
            read(self.name, x, memory[x - base : b - base])
            io += time.perf_counter() - t0
        self.clock.add_folded(t_first, time.perf_counter(), (io, b - a), (crc_s, folded))

    def settle(self, p: int) -> None:
        """After ``read_bytes(p)``: verify the units piece ``p`` completed and hand on the needs
        they (or it) completed; raises ``ChecksumMismatchError`` for a unit that differs."""
        lo, hi = self._pieces[p]
        finished = []
        with self._lock:
            for u in self._units_in(lo, hi):
                self._unit_left[u] -= 1
                if self._unit_left[u] == 0:
                    finished.append(u)
            ready = _count_down(self._piece_needs[p])
        for u in finished:
            self._unit_done(u)
        self._needs_done(ready)
        self._release(self._segments_in(lo, hi))

    def start(self) -> None:
        """For a run with nothing to read (empty needs, unverified stretches): hand on its needs."""
        if not self._pieces:
            self._needs_done(self.needs)

    def _unit_done(self, u: int) -> None:
        if self.verify:
            self._check(u)
        lo, hi = self.units.starts[u], self.units.ends[u]
        with self._lock:
            ready = _count_down(self._unit_needs[u])
        self._needs_done(ready)
        self._release(self._segments_in(lo, hi))

    def _check(self, u: int) -> None:
        lo, hi, want = self.units.starts[u], self.units.ends[u], self.units.crcs[u]
        with self._lock:
            folded = self._unit_next[u] == hi and hi > lo
        if folded:  # every byte was folded in as it was read (``_read_folded``)
            crc = self._unit_crc[u]
        else:
            crc = 0
            t0 = time.perf_counter()
            for seg in self._segments_in(lo, hi):
                a, b = max(lo, seg.lo), min(hi, seg.hi)
                assert seg.view is not None
                crc = crc32c(seg.view[a - seg.lo : b - seg.lo], crc)
            self.clock.add_checksum(t0, time.perf_counter(), hi - lo)
        if crc != want:
            named = self.holders(lo, hi) if self.holders is not None else [repr(n.what) for n in self._unit_needs[u]]
            holders = ", ".join(named[:6]) + (f" and {len(named) - 6} more" if len(named) > 6 else "")
            raise ChecksumMismatchError(
                f"rank {self.rank}: checksum mismatch in {self.source}/{self.name} bytes [{lo}, {hi}) "
                f"(holding {holders or 'nothing named'}): stored {want:#010x}, read {crc:#010x} (the file is corrupt)"
            )

    def _needs_done(self, ready: Sequence[Need]) -> None:
        """Hand on needs whose bytes are all read and verified: copy each into its ``into``
        (plain byte copies, one clock reading for the batch), call its ``done``, then release
        their segments (one lock for the batch)."""
        if not ready:
            return
        held: list[_Segment] = []
        t0 = time.perf_counter()
        copied = 0
        for need in ready:
            if need.bounced:  # its segments copy themselves to the device once verified
                continue
            seg = need.segment
            if seg is None:  # an empty need: nothing was read
                if need.done is not None:
                    need.done(torch.empty(0, dtype=torch.uint8))
                continue
            if need.into:
                view = seg.view
                assert view is not None
                for at, into in need.into:
                    n = len(into)
                    into[:] = view[at - seg.lo : at - seg.lo + n]
                    copied += n
            if need.done is not None:
                memory = seg.memory
                assert memory is not None
                need.done(memory[need.lo - seg.lo : need.hi - seg.lo])
            held.append(seg)
        if copied and self.copied is not None:
            self.copied(t0, time.perf_counter(), copied)
        self._release(held)

    def _release(self, segments: Sequence[_Segment]) -> None:
        """One less thing pending in each of ``segments``; a temporary with nothing pending is
        freed (its bytes are verified and copied out); a bounced one is copied to the device
        first (its bytes are read and every unit overlapping it is verified)."""
        bounced = []
        with self._lock:
            for seg in segments:
                seg.pending -= 1
                if seg.pending == 0 and not seg.direct:
                    if seg.bounce is not None:
                        bounced.append((seg.bounce, seg.device))
                        seg.bounce = None
                    seg.memory, seg.view = None, memoryview(b"")
        for bounce, target in bounced:
            assert self.device is not None and target is not None
            self.device.copy(bounce, target)


def _clear_after(ordered: Sequence[Need], i: int) -> bool:
    """Whether no need after ``ordered[i]`` (sorted by start) overlaps it."""
    return i + 1 == len(ordered) or ordered[i + 1].lo >= ordered[i].hi


def _count_down(needs: list[Need]) -> list[Need]:
    """One more of each need's parts is done (caller holds the lock); the needs now complete."""
    ready = []
    for need in needs:
        need.left -= 1
        if need.left == 0:
            ready.append(need)
    return ready


# --------------------------------------------------------------------------- one rank's reads


def read_needs(
    md: Metadata,
    storage: Storage,
    wanted: list[Need],
    cached: set[int],
    threads: int,
    verify: bool,
    rank: int,
    spans: dict[str, list[float]],
    copied: Copied,
    clock: ReadClock | None = None,
    device: DeviceCopies | None = None,
    kept: ReaderThreads | None = None,
) -> int:
    """Read every need of this rank (``cached``: the indices of those read through the shared
    page cache): spans -> runs (``planning.load.runs``) -> one reader pool over the pieces of
    all runs; returns the bytes read. ``spans`` (monitoring): per file, the first piece's start,
    the last piece's end and the bytes read; ``copied`` times the runs' copies of small needs
    into place (``Need.into``); ``clock`` (monitoring) sums the time in read calls and checksums;
    ``device``: the bounce buffers of needs with a CUDA destination (``engine.load.device``);
    ``kept``: the checkpointer's reader threads (``schedule.ReaderThreads``; None: this call's own)."""
    index = {f: i for i, f in enumerate(md.files)}
    names = {index[n.name]: n.what for n in wanted}
    wanted, cached = _group_small(wanted, cached)
    tagged = [Span(index[n.name], n.lo, n.hi, t) for t, n in enumerate(wanted)]
    runs = plan_runs(tagged, extent_of(md, verify))
    _check_files(md, storage, runs, names, rank)
    jobs = _run_jobs(md, storage, runs, wanted, cached, verify, rank, copied, clock, device)
    read_pieces(jobs, threads, spans, storage.capabilities.reads_ahead, kept)
    return sum(job.nbytes for job in jobs)


def _run_jobs(
    md: Metadata,
    storage: Storage,
    runs: list[Run],
    wanted: list[Need],
    cached: set[int],
    verify: bool,
    rank: int,
    copied: Copied,
    clock: ReadClock | None = None,
    device: DeviceCopies | None = None,
) -> list[RunJob]:
    """A ``RunJob`` per run: read through the shared page cache when one of its needs is, its
    checksum units, its needs."""
    cover = cover_of(md, verify)
    fused = FUSED if storage.capabilities.reads_ahead else 0  # one reader per file, in file order
    jobs = []
    for run in runs:
        read = storage.read_into_cached if any(t in cached for t in run.tags) else storage.read_into
        units = cover(run.file_index, run.lo, run.hi)
        holders = functools.partial(_holders, md, run.file_index)
        needs = [wanted[t] for t in run.tags]
        name = md.files[run.file_index]
        jobs.append(
            RunJob(
                run,
                name,
                needs,
                units,
                read,
                verify,
                storage.url,
                rank,
                holders,
                copied=copied,
                clock=clock,
                device=device,
                fused=fused,
            )
        )
    return jobs


_GROUP_BYTES = 1 << 20  # small needs are grouped up to this many bytes


def _group_small(wanted: list[Need], cached: set[int]) -> tuple[list[Need], set[int]]:
    """``wanted`` with each stretch of small needs (only copied as bytes: ``Need.into``) that
    follow each other in the list and in one file, each starting at most ``MERGE_GAP`` bytes
    after the previous one ends, as one need serving them all (up to ``_GROUP_BYTES``), and the
    indices of the needs read through the shared page cache (a group is if one of its needs
    is). Such needs share a run anyway (``plan_runs`` merges them), so the runs, the bytes read
    and the units verified are the same; the runs only handle a need per group, not per tensor."""
    out: list[Need] = []
    out_cached: set[int] = set()
    group: list[Need] = []
    group_cached = False

    def close() -> None:
        if not group:
            return
        if group_cached:
            out_cached.add(len(out))
        if len(group) == 1:
            out.append(group[0])
        else:
            first, last = group[0], group[-1]
            into = tuple(piece for n in group for piece in n.into)
            out.append(Need(first.name, first.lo, last.hi, None, first.what, None, into))
        group.clear()

    for t, need in enumerate(wanted):
        small = need.done is None and need.dest is None and bool(need.into)
        if not small:
            close()
            group_cached = False
            if t in cached:
                out_cached.add(len(out))
            out.append(need)
            continue
        if group:
            prev = group[-1]
            joins = (
                need.name == prev.name
                and prev.hi <= need.lo <= prev.hi + MERGE_GAP
                and need.hi - group[0].lo <= _GROUP_BYTES
            )
            if not joins:
                close()
        if not group:
            group_cached = False
        group.append(need)
        group_cached = group_cached or t in cached
    close()
    return out, out_cached


def _holders(md: Metadata, file_index: int, lo: int, hi: int) -> list[str]:
    """The tensors and blobs with bytes in ``[lo, hi)`` of one file (for a checksum error)."""
    out = [
        repr(fqn)
        for fqn, rec in md.tensors.items()
        if any(
            s.file_index == file_index and s.byte_offset < hi and lo < s.byte_offset + s.byte_length for s in rec.shards
        )
    ]
    out += [
        f"blob {b.key!r}"
        for b in md.blobs.values()
        if b.file_index == file_index and b.byte_offset < hi and lo < b.byte_offset + b.byte_length
    ]
    return out


def _check_files(md: Metadata, storage: Storage, runs: list[Run], names: dict[int, str], rank: int) -> None:
    """Every file this rank reads is complete (``folder.files``: a regular file of at least its
    expected size), before allocating anything."""
    need = sorted({run.file_index for run in runs})
    holding = {f: repr(names.get(f, "?")) for f in need}
    raise_problem(data_files(storage, md, indices=need), md, storage.url, f"rank {rank}: ", holding)
