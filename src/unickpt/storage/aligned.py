"""Page-aligned host buffers, allocated once and reused (direct I/O bounce buffers, staging).

Touching fresh pages is several times slower than copying into pages already touched (figures:
docs/performance.md, "Internals"), so buffers come from a process-wide pool and go back to it.
Anonymous mmaps are page aligned, as O_DIRECT requires. Used by ``storage.local`` (the bounce
buffers of direct I/O, ``BOUNCE_POOL``) and ``engine.save.staging`` (the async save's staging
buffers).
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

__all__ = ["ALIGN", "AlignedBuffer", "BufferPool", "BOUNCE_POOL", "address_of", "is_aligned"]

ALIGN = 4096


def address_of(view: memoryview) -> int:
    if len(view) == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def is_aligned(view: memoryview) -> bool:
    return address_of(view) % ALIGN == 0


_NOTHING = memoryview(b"")  # the view of a closed buffer


class AlignedBuffer:
    """A page-aligned, pre-faulted byte buffer of fixed capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(ALIGN, -(-capacity // ALIGN) * ALIGN)
        # fault every page in now (the kernel does it in bulk with MAP_POPULATE, ~2x faster than
        # touching page by page), so the first real use runs at memcpy speed
        populate = getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        self._mm: mmap.mmap | None = mm
        self.view = memoryview(mm)
        if not populate:
            np.frombuffer(self.view, dtype=np.uint8)[::ALIGN] = 0

    def close(self) -> None:
        """Give the memory back: unmapped at once when nothing views it any more, else when the
        last view goes. ``torch.frombuffer(self.view)`` (the staging images) keeps a reference to
        the view but no buffer export, so ``mmap.close()`` would unmap the pages under a live
        tensor, and a late copy would write into unmapped memory or memory mapped again since
        (the heap: issue 39, item 27). Dropping the references lets the last one unmap."""
        self.view = _NOTHING
        self._mm = None


class BufferPool:
    """Hands out AlignedBuffers of one chunk size; keeps up to ``keep`` free ones."""

    def __init__(self, chunk: int, keep: int) -> None:
        self.chunk, self.keep = chunk, keep
        self._free: list[AlignedBuffer] = []
        self._lock = threading.Lock()

    def get(self) -> AlignedBuffer:
        with self._lock:
            if self._free:
                return self._free.pop()
        return AlignedBuffer(self.chunk)

    def put(self, buf: AlignedBuffer) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)
                return
        buf.close()


# direct-write bounce buffers: one per concurrent writer thread is enough
BOUNCE_POOL = BufferPool(chunk=16 << 20, keep=8)
