"""Host-to-device copies of one read stage: a load onto CUDA tensors.

``engine.load.stage.read_stage`` creates one ``DeviceCopies`` when some destination of the load
is a CUDA tensor (``DeviceCopies.for_items``), hands it to the needs it builds and to
``engine.load.reader.read_needs``, and calls ``finish`` at its end, whatever happened. In
between, on the reader and verifier threads:

* a need whose bytes land whole in one contiguous region of a CUDA destination with the saved
  dtype (``Need.device``) is read by its ``RunJob`` piece by piece into *bounce buffers*
  (``acquire``): reusable pinned host buffers of ``slot_bytes`` from a pool of at most ``slots``,
  allocated lazily on first use (so a small load pins little) and dropped by ``finish``;
* once every checksum unit overlapping a piece is verified on the host bytes, the run hands the
  buffer to ``copy``: a ``non_blocking`` host-to-device copy on a side stream of the target's
  device, and an event recorded after it (one event per buffer); the buffer goes back to the
  pool only after that event completed (``acquire`` waits for the oldest copy in flight when
  no buffer is free);
* when every buffer is held by pieces still waiting for their checksum units (a unit straddling
  pieces, per-shard checksums of old formats), ``acquire`` returns plain host memory of the
  piece instead, copied synchronously: never a wait that could not end, and no more memory
  than the temporaries the CPU path allocates;
* every other CUDA destination (dtype casts, partial boxes of a resharding load, small tensors,
  forwarded shards) is filled by ``stage._apply`` inside ``stream(device)``: the verified host
  bytes copied to the device once, then the box copies and casts run there.

``finish`` waits for every copy (the side streams synchronised: the load returns with the data
in place) and makes the caller's current stream wait on the side streams; the side streams
waited on the caller's current stream when they were created, so work already queued on the
destinations (their initialisation) comes first.

CPU-only loads never create one. Tests on hosts without CUDA drive the same pool with CPU
"device" targets (``pin=False``): plain buffers, synchronous copies, no streams or events.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Bounce", "DeviceCopies"]


@dataclass(eq=False)
class Bounce:
    """Host memory one piece is read into: ``memory`` (uint8, the piece's length), from pool slot
    ``slot`` (-1: plain host memory outside the pool)."""

    memory: torch.Tensor
    slot: int


class DeviceCopies:
    """The bounce-buffer pool, side streams and copy events of one read stage (module docstring).
    ``copied`` (monitoring) is told ``(start, end, bytes)`` of each copy issued."""

    def __init__(
        self,
        devices: Iterable[torch.device],
        slots: int,
        slot_bytes: int,
        pin: bool = True,
        copied: Callable[[float, float, int], None] | None = None,
    ) -> None:
        self.slots, self.slot_bytes, self.pin, self.copied = max(1, slots), slot_bytes, pin, copied
        self._lock = threading.Lock()
        self._memory: list[torch.Tensor] = []  # one buffer per slot allocated so far
        self._events: list[Any] = []  # torch.cuda.Event per slot (pinned pools only)
        self._free: list[int] = []
        self._in_flight: deque[int] = deque()  # slots whose copy was issued, oldest first
        self._streams: dict[torch.device, Any] = {}
        if pin:
            for device in devices:
                if device.type == "cuda" and device not in self._streams:
                    stream = torch.cuda.Stream(device)
                    stream.wait_stream(torch.cuda.current_stream(device))  # the destinations' pending work first
                    self._streams[device] = stream
        self.bounced = 0  # bytes copied from pool buffers (tests, monitoring)
        self.unpooled = 0  # bytes copied from plain host memory (pool exhausted)

    @classmethod
    def for_items(
        cls, tensors: Iterable[torch.Tensor], readers: int, slot_bytes: int, backlog: int, copied: Callable | None
    ) -> DeviceCopies | None:
        """One for a read stage whose destinations include CUDA tensors (None otherwise): enough
        buffers for every reader's pieces in flight (``backlog`` read and waiting for their
        checksums, one being read, one being copied)."""
        devices = {t.device for t in tensors if t.is_cuda}
        if not devices:
            return None
        return cls(sorted(devices, key=str), max(1, readers) * (backlog + 2), slot_bytes, True, copied)

    def handles(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a destination these copies fill (a CUDA tensor; any tensor in CPU
        test mode)."""
        return t.is_cuda or not self.pin

    @contextlib.contextmanager
    def stream(self, device: torch.device) -> Iterator[None]:
        """Run the enclosed device work on the side stream of ``device`` (no grad recorded)."""
        side = self._streams.get(device)
        with torch.no_grad():
            if side is None:
                yield
            else:
                with torch.cuda.stream(side):
                    yield

    def acquire(self, nbytes: int) -> Bounce:
        """Host memory for a piece of ``nbytes``: a free pool buffer, else the buffer of the
        oldest copy in flight if that copy completed, else a new one while the pool is not full,
        else the oldest copy's buffer once it completed (a wait), else (every buffer held by
        pieces still waiting for their checksums) plain host memory."""
        if nbytes <= self.slot_bytes:
            slot = self._take()
            if slot is not None:
                return Bounce(self._memory[slot][:nbytes], slot)
        return Bounce(torch.empty(nbytes, dtype=torch.uint8), -1)

    def _take(self) -> int | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._in_flight and self._events[self._in_flight[0]].query():  # the oldest copy is done
                return self._in_flight.popleft()
            if len(self._memory) < self.slots:
                slot = len(self._memory)
                self._memory.append(torch.empty(0, dtype=torch.uint8))  # reserved; filled below
                self._events.append(None)
                fresh = True
            elif self._in_flight:
                slot, fresh = self._in_flight.popleft(), False
            else:
                return None
        if fresh:  # pinned allocation outside the lock (the first load in a process pays it)
            memory, pinned = _host_buffer(self.slot_bytes, self.pin)
            self._memory[slot] = memory
            if pinned:
                self._events[slot] = torch.cuda.Event()
        else:
            event = self._events[slot]
            if event is not None:
                event.synchronize()  # its copy has completed: the buffer may be overwritten
        return slot

    def copy(self, bounce: Bounce, target: torch.Tensor) -> None:
        """Copy ``bounce``'s verified bytes into ``target`` (uint8, same length) on the side
        stream of its device; the buffer returns to the pool once the copy completed."""
        t0 = time.perf_counter()
        n = bounce.memory.numel()
        event = self._events[bounce.slot] if bounce.slot >= 0 else None  # None: not pinned memory
        with self.stream(target.device):
            if event is None:  # plain host memory: a synchronous copy, the memory may be reused after
                target.copy_(bounce.memory)
            else:
                target.copy_(bounce.memory, non_blocking=True)
                event.record(self._streams[target.device])
        with self._lock:
            if bounce.slot < 0:
                self.unpooled += n
            else:
                self.bounced += n
                (self._in_flight if event is not None else self._free).append(bounce.slot)
        if self.copied is not None:
            self.copied(t0, time.perf_counter(), n)

    def give_back(self, bounce: Bounce) -> None:
        """Return a buffer whose bytes are not copied (its piece belongs to a failed load)."""
        if bounce.slot >= 0:
            with self._lock:
                self._free.append(bounce.slot)

    def finish(self) -> None:
        """The end of the read stage, on the caller's thread, after every reader stopped: wait
        for every copy, make the caller's current stream wait on the side streams, drop the pool."""
        for device, side in self._streams.items():
            side.synchronize()
            torch.cuda.current_stream(device).wait_stream(side)
        with self._lock:
            self._memory, self._events, self._free = [], [], []
            self._in_flight.clear()


def _host_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
    """A pool buffer and whether it is page-locked: plain memory (copied synchronously) when
    ``pin`` is off or no page-locked memory can be had (a container's limit)."""
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError:
            pass
    return torch.empty(nbytes, dtype=torch.uint8), False
