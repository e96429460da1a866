"""Executing one rank's reads: runs of bytes read in parallel, verified unit by unit, and each
need placed as soon as the units covering it are verified.

``engine.read.read_stage`` turns the saved shards a rank reads into ``Need``s (a byte range of a
data file and where it lands), groups them into runs (``planning.byte_runs.plan_runs``) and
hands every run to a ``RunJob``. A run's bytes land, piece by piece, in *segments*: the
destination memory itself for a need that has one contiguous destination (``Need.dest``: a live
tensor, or the buffer a batch is forwarded from), and temporaries for everything else (small
tensors read together, parts of shards that are copied elsewhere, chunk edges). Pieces are cut
at 16 MiB lines of file offset and read by the reader pool in any order; the thread finishing
the last piece of a checksum unit verifies it, and the thread verifying the last unit of a need
hands it on: the bytes of small tensors with contiguous destinations (``Need.into``) are
copied there as plain bytes, in a batch with the others that unit completes; any other need is
handed to ``Need.done`` (copies into place). Temporaries are allocated when their first piece
starts and dropped when their last need is done, so memory stays near the bytes in flight.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import crc32c
import torch

from ..errors import ChecksumMismatchError
from ..format.checksums import Units
from ..planning.byte_runs import Run
from .bytes_view import tensor_bytes

__all__ = ["Need", "RunJob", "PIECE"]

PIECE = 16 << 20  # runs are read as parallel ranged reads cut at multiples of this file offset


@dataclass(eq=False)
class Need:
    """Bytes ``[lo, hi)`` of file ``name`` that this rank reads; ``dest``: where they land when
    they have one contiguous destination (exactly ``hi - lo`` bytes), else a temporary; ``into``:
    for a need read into a temporary, contiguous destinations the run copies bytes into itself
    once every unit covering ``[lo, hi)`` is verified, as ``(file offset, byte view)`` pairs
    inside ``[lo, hi)`` (small tensors read with their neighbours: one need may serve several);
    ``done`` (if any): called with the bytes (a uint8 tensor) after that; ``what``: names the
    need in errors (the tensor, the blob)."""

    name: str
    lo: int
    hi: int
    done: Callable[[torch.Tensor], None] | None
    what: str
    dest: torch.Tensor | None = None
    into: tuple[tuple[int, memoryview], ...] = ()
    left: int = 0  # units still to verify (set by RunJob)
    segment: _Segment | None = field(default=None, repr=False)


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
    ) -> None:
        self.run, self.name, self.needs, self.units = run, name, list(needs), units
        self.read_into, self.verify, self.source, self.rank = read_into, verify, source, rank
        self.holders = holders  # what bytes [lo, hi) of the file hold (for errors)
        self.piece = piece
        self.copied = copied
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

    # ------------------------------------------------------------------ layout

    def _segments(self) -> list[_Segment]:
        """Direct destinations where needs have them; temporaries over every other stretch, cut
        between needs once they reach ``PIECE`` bytes (so a temporary is freed while later parts
        of a long run are still being read)."""
        out: list[_Segment] = []
        pos = end = self.run.lo  # start of the open temporary; end of the needs so far
        for need in sorted(self.needs, key=lambda n: (n.lo, n.hi)):
            if need.hi <= need.lo:
                continue
            alone = need.lo >= end  # overlaps no earlier need
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
            if need.hi > need.lo:
                need.segment = out[bisect.bisect_right(starts, need.lo) - 1]
                need.segment.pending += 1
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
        with self._lock:
            if seg.view is None:  # the first piece into a temporary allocates it
                seg.memory = torch.empty(seg.hi - seg.lo, dtype=torch.uint8)
                seg.view = tensor_bytes(seg.memory)
            return seg.view

    def read_piece(self, p: int) -> None:
        """Read piece ``p`` of the run into its segments; then verify the units it completed
        and hand on the needs they (or it) completed."""
        lo, hi = self._pieces[p]
        for seg in self._segments_in(lo, hi):
            a, b = max(lo, seg.lo), min(hi, seg.hi)
            self.read_into(self.name, a, self._memory(seg)[a - seg.lo : b - seg.lo])
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
        crc = 0
        for seg in self._segments_in(lo, hi):
            a, b = max(lo, seg.lo), min(hi, seg.hi)
            assert seg.view is not None
            crc = crc32c.crc32c(seg.view[a - seg.lo : b - seg.lo], crc)
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
        freed (its bytes are verified and copied out)."""
        with self._lock:
            for seg in segments:
                seg.pending -= 1
                if seg.pending == 0 and not seg.direct:
                    seg.memory, seg.view = None, memoryview(b"")


def _count_down(needs: list[Need]) -> list[Need]:
    """One more of each need's parts is done (caller holds the lock); the needs now complete."""
    ready = []
    for need in needs:
        need.left -= 1
        if need.left == 0:
            ready.append(need)
    return ready
