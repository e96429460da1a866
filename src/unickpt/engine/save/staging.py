"""Snapshot staging: the bytes a rank writes, made safe from training for the whole save.

A blocking save writes straight from the live tensors (zero copy, ``live_parts``), unless some
live on an accelerator (``on_device``): then it stages like an async save and waits. An async save
snapshots them first (``StagingPool.stage``): every written entry is copied into a *file image*,
one page-aligned host buffer per data file laid out exactly as the file, so the writers can send
it to disk with O_DIRECT and no further copy. Buffers are allocated once and reused (two slots,
ping-pong: a save can stage into one while the previous still writes from the other), so the
pool never holds more than 2x this rank's checkpoint bytes. On CUDA the images are pinned and the
device-to-host copies run on a side stream; the training stream waits on the copy's event, so
the next optimizer step (or any kernel) can not modify a tensor before its snapshot is taken,
while the host returns at once. On CPU, the entries the caller marks ``later`` (tensors only
``optimizer.step()`` modifies, see ``step_guard``) are copied by the snapshot thread after
``stage`` returns; ``StagedFiles.copied`` tells when, and the writer waits for it.
With ``shared=True`` (``SaveOptions(writer="process")``) the images are ``SharedImage``s
(memfd shared memory) that the pool's ``WriterProcess`` maps and writes (``writer_process``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ...errors import SnapshotConflictError
from ...planning.save.model import ENTRY_ALIGN, RankSavePlan, WriteEntry
from ...planning.specs import SaveItem
from ...storage.aligned import AlignedBuffer
from ...storage.base import Buffer
from ..bytes_view import tensor_bytes
from .writer_process import SharedImage, WriterProcess

__all__ = ["live_parts", "on_device", "StagedFiles", "StagingPool"]


def live_parts(
    items: list[SaveItem], plan: RankSavePlan, blobs: dict[str, bytes]
) -> tuple[dict[str, list[Buffer]], list[Buffer]]:
    """For a blocking save: each file's parts (entries and the zero padding between them),
    viewing the live tensors (CPU) or a host copy, and each entry's bytes in plan order."""
    out: dict[str, list[Buffer]] = {}
    entries: list[Buffer] = []
    file, parts, end = None, None, 0
    with torch.no_grad():
        for e in plan.entries:
            if e.file != file:  # entries are grouped by file, in byte order
                file = e.file
                parts = out.get(file)
                if parts is None:
                    parts = out[file] = []
                    end = 0
                else:  # not grouped after all: where this file's parts end
                    end = _end_of(plan, file, e)
            assert parts is not None
            gap = e.byte_offset - end
            if gap:
                parts.append(_PADDING[gap] if 0 < gap < len(_PADDING) else bytes(gap))  # alignment padding
            end = e.byte_offset + e.byte_length
            if e.blob_key:
                data: Buffer = blobs[e.blob_key]
            else:
                t = items[e.item_index].tensor
                data = tensor_bytes(t if t.is_cpu else t.detach().cpu())
            parts.append(data)
            entries.append(data)
    return out, entries


def on_device(items: list[SaveItem], plan: RankSavePlan) -> bool:
    """Whether any tensor ``plan`` writes lives on an accelerator: a blocking save then stages
    through the pool's pinned images (one side-stream copy) instead of ``live_parts``."""
    return any(not items[e.item_index].tensor.is_cpu for e in plan.entries if not e.blob_key)


_PADDING = [bytes(n) for n in range(ENTRY_ALIGN)]  # the zero gaps before aligned entries


def _end_of(plan: RankSavePlan, file: str, before: WriteEntry) -> int:
    """Where ``file``'s entries placed before ``before`` end (plans that interleave files)."""
    end = 0
    for e in plan.entries:
        if e is before:
            return end
        if e.file == file:
            end = e.byte_offset + e.byte_length
    return end


@dataclass
class _Slot:
    buffers: list[_Image] = field(default_factory=list)
    busy: bool = False


@dataclass
class StagedFiles:
    """File images of one staged save; ``release()`` returns the slot once written."""

    parts: dict[str, list[Buffer]]
    ready: torch.cuda.Event | None
    _pool: StagingPool
    _slot: _Slot
    nbytes: int
    copied: Future[None] | None = None  # the background part of the copy (CPU), if any
    shared: dict[str, SharedImage] | None = None  # shared=True: each file's image (None: private)

    def wait_ready(self) -> None:
        """Block until every byte is in the images; re-raises a failed background copy."""
        if self.copied is not None:
            self.copied.result()
        if self.ready is not None:
            self.ready.synchronize()

    def release(self) -> None:
        """Return the slot to the pool once nothing writes into its images any more: at once
        when the copies are complete, else as the background copy (``copied``) ends, and on
        CUDA after the side-stream copy (``ready``). A save refused at its lock stage
        (``run_locked``'s ``on_refused``) releases while the snapshot thread may still copy
        into the images, and the next ``stage`` of the slot may free them (``_fit``: munmap):
        that copy wrote into unmapped memory, or into memory malloc had handed out since
        (issue 39, item 27)."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.copied is None:
            self._pool._release(self._slot)
        else:  # at once when the copy is done, else on the snapshot thread as it ends (either way)
            self.copied.add_done_callback(lambda _: self._pool._release(self._slot))


class StagingPool:
    """Two (``slots``) reusable sets of file images, the snapshot thread that fills deferred
    entries and the writer process of shared images (``writer``, started by the first
    ``shared`` stage). Owned by a ``Checkpointer``; ``close()`` stops the process and frees the
    memory once no save uses it."""

    def __init__(self, slots: int = 2) -> None:
        self._slots = [_Slot() for _ in range(slots)]
        self._cond = threading.Condition()
        self._stream: torch.cuda.Stream | None = None
        # copies the deferred part of snapshots (normal priority: an optimizer step may wait on
        # it); its one thread starts at the first submit
        self._snapshotter = ThreadPoolExecutor(1, thread_name_prefix="unickpt-snapshot")
        self.writer = WriterProcess()

    def close(self) -> None:
        """Wait for snapshot copies in flight, stop the snapshot thread and free every buffer
        (the caller has drained its saves: no slot is busy)."""
        self._snapshotter.shutdown(wait=True)
        self.writer.close()
        with self._cond:
            for slot in self._slots:
                for b in slot.buffers:
                    if not isinstance(b, torch.Tensor):
                        b.close()
                slot.buffers = []

    def capacity_bytes(self) -> int:
        return sum(_cap(b) for s in self._slots for b in s.buffers)

    def _free(self, b: _Image) -> None:
        """Free an image no slot keeps (the writer process unmaps a shared one at its next request)."""
        if isinstance(b, SharedImage):
            self.writer.forget(b)
        if not isinstance(b, torch.Tensor):
            b.close()

    def _acquire(self) -> _Slot:
        with self._cond:
            while True:
                for s in self._slots:
                    if not s.busy:
                        s.busy = True
                        return s
                self._cond.wait()

    def _release(self, slot: _Slot) -> None:
        with self._cond:
            slot.busy = False
            self._cond.notify_all()

    def stage(
        self,
        items: list[SaveItem],
        plan: RankSavePlan,
        blobs: dict[str, bytes],
        later: Callable[[SaveItem], bool] | None = None,
        shared: bool = False,
    ) -> StagedFiles:
        """Copy every entry of ``plan`` into a free slot's file images (blocks while both are
        busy); CPU tensor entries whose item satisfies ``later`` are copied on the snapshot
        thread after the return (``StagedFiles.copied``). ``shared``: into ``SharedImage``s for
        the writer process (CPU tensors only; it is started here if it does not run)."""
        sizes: dict[str, int] = {}
        for e in plan.entries:
            sizes[e.file] = max(sizes.get(e.file, 0), e.byte_offset + e.byte_length)
        files = list(sizes)
        cuda = any(items[e.item_index].tensor.is_cuda for e in plan.entries if not e.blob_key)
        shared = shared and not cuda
        if shared:
            self.writer.start()
        slot = self._acquire()
        copied: Future[None] | None = None
        try:
            _fit(slot, [sizes[f] for f in files], pinned=cuda, shared=shared, free=self._free)
            images = {f: _as_uint8(slot.buffers[i])[: sizes[f]] for i, f in enumerate(files)}
            stream = None
            if cuda:
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                stream = self._stream
                stream.wait_stream(torch.cuda.current_stream())
            now: list[WriteEntry] = []
            deferred: list[WriteEntry] = []
            for e in plan.entries:
                defer = (
                    later is not None
                    and not e.blob_key
                    and items[e.item_index].tensor.is_cpu
                    and later(items[e.item_index])
                )
                (deferred if defer else now).append(e)
            with torch.cuda.stream(stream) if stream is not None else _null():
                _copy_entries(now, items, images, blobs, non_blocking=stream is not None)
            ready = None
            if stream is not None:
                ready = torch.cuda.Event()
                ready.record(stream)
                torch.cuda.current_stream().wait_event(ready)  # training kernels run after the copy
            parts: dict[str, list[Buffer]] = {
                f: [memoryview(images[f].numpy()).cast("B")] if sizes[f] else []  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
                for f in files
            }
            if deferred:  # version counters read now, in the call: the state the save stands for
                versions = [items[e.item_index].tensor._version for e in deferred]
                copied = self._snapshotter.submit(_copy_checked, deferred, versions, items, images)
            shared_images = None
            if shared:
                shared_images = {f: b for f, b in zip(files, slot.buffers) if isinstance(b, SharedImage)}
            return StagedFiles(parts, ready, self, slot, sum(sizes.values()), copied, shared_images)
        except BaseException:  # e.g. a KeyboardInterrupt of an application's own SIGINT handler
            if copied is None:
                self._release(slot)
            else:  # the snapshot thread copies into the images: the slot goes back once it ended
                copied.add_done_callback(lambda _: self._release(slot))
            raise


def _copy_entries(
    entries: list[WriteEntry],
    items: list[SaveItem],
    images: dict[str, torch.Tensor],
    blobs: dict[str, bytes],
    non_blocking: bool = False,
) -> None:
    """Copy each entry's bytes to its place in the file images. Small CPU tensors go as one
    memoryview assignment of their row-major bytes (~2 us; a torch copy into a typed view of the
    image costs ~6 us); large ones, and any other device, by torch."""
    flat: dict[str, memoryview] = {}
    with torch.no_grad():
        for e in entries:
            if e.blob_key:
                if e.byte_length:
                    image = images[e.file][e.byte_offset : e.byte_offset + e.byte_length]
                    image.copy_(torch.frombuffer(bytearray(blobs[e.blob_key]), dtype=torch.uint8))
                continue
            src = items[e.item_index].tensor
            if src.is_cpu and e.byte_length <= _SMALL and not non_blocking:
                mv = flat.get(e.file)
                if mv is None:
                    mv = flat[e.file] = memoryview(images[e.file].numpy())  # type: ignore[arg-type]  # numpy stubs
                try:
                    data = tensor_bytes(src)
                except RuntimeError:  # a conjugate / negative view: torch resolves it below
                    data = None
                if data is not None and len(data) == e.byte_length:
                    mv[e.byte_offset : e.byte_offset + e.byte_length] = data
                    continue
            src = src.detach()
            if src.numel() == 0:
                continue
            dst = images[e.file][e.byte_offset : e.byte_offset + e.byte_length]
            dst.view(src.dtype).view(src.shape).copy_(src, non_blocking=non_blocking)


_SMALL = 256 << 10  # entries up to this size are copied as bytes (one memcpy under the GIL)


def _copy_checked(
    entries: list[WriteEntry], versions: list[int], items: list[SaveItem], images: dict[str, torch.Tensor]
) -> None:
    """The background copy; refuses (SnapshotConflictError) if a source changed in place since
    the save call, detected by torch's version counters (in-place ops bump them; ``.data``
    writes don't)."""
    _copy_entries(entries, items, images, {})
    for e, v in zip(entries, versions):
        t = items[e.item_index].tensor
        if t._version != v:
            raise SnapshotConflictError(
                f"{items[e.item_index].spec.fqn!r} was modified in place while the async save was "
                "copying it in the background (outside optimizer.step(), which waits for the copy); "
                "call handle.wait_snapshot() before such changes, or save with "
                "SaveOptions(background_snapshot=False)"
            )


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


_Image = AlignedBuffer | SharedImage | torch.Tensor  # private, shared (writer process), pinned


def _cap(b: _Image) -> int:
    return b.numel() if isinstance(b, torch.Tensor) else b.capacity


def _as_uint8(b: _Image) -> torch.Tensor:
    return b if isinstance(b, torch.Tensor) else torch.frombuffer(b.view, dtype=torch.uint8)


def _kind(b: _Image) -> str:
    return "pinned" if isinstance(b, torch.Tensor) else "shared" if isinstance(b, SharedImage) else "private"


def _fit(
    slot: _Slot, sizes: list[int], pinned: bool, shared: bool = False, free: Callable[[_Image], None] | None = None
) -> None:
    """Make the slot hold one buffer per file, each at least as large; reuse what fits tightly
    (at most one page larger: with an unchanged layout, the same buffers), free the rest, so the
    pool holds at most 2x this rank's checkpoint bytes once both slots served the layout."""
    kind = "pinned" if pinned else "shared" if shared else "private"
    have = sorted(slot.buffers, key=_cap)
    out: list[_Image] = []
    for size in sizes:
        fits = (size <= _cap(b) <= max(size, 1) + 4096 and _kind(b) == kind for b in have)
        at = next((i for i, ok in enumerate(fits) if ok), None)
        if at is not None:  # by position: ``list.remove`` would compare pinned tensors with ``==``
            pick = have.pop(at)
        elif pinned:
            pick = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=True)
        elif shared:
            pick = SharedImage(size)
        else:
            pick = AlignedBuffer(size)
        out.append(pick)
    for b in have:
        if free is not None:
            free(b)
        elif not isinstance(b, torch.Tensor):
            b.close()
    slot.buffers = out
