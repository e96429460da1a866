"""The read stage of a load (every rank, collective): read and place every saved shard this rank
needs, with the plan of ``planning.load``.

Used by the load pipeline (its read stage and its probes) and by ``ops.pieces`` (a checkpoint read
piece by piece, without a model), so both read through one verified path. Order (``read_stage``):
the read assignment (``_assign``: the needs exchanged at the coordinator,
``engine.load.exchange``, when several ranks deduplicate reads) -> the needs of this rank
(``_needs``: what each saved shard's bytes are and where they land,
``planning.load.runs.place_need``) -> forwarding set up (``engine.load.forwarding.Transfer``:
receives posted) -> every need read (``engine.load.reader.read_needs``), each forwarded batch sent
the moment its last shard is verified -> every transfer completed -> all ranks agree the reads
succeeded -> received batches copied into place (``_place_received``) -> with CUDA
destinations and ``ReadOptions.pinned_device_copies``, every host-to-device copy completed
(``engine.load.device.DeviceCopies``: made before the needs, whose contiguous CUDA regions it
bounces, finished whatever happened; without the option each piece is read into host memory and
copied with a blocking copy) -> monitoring events (``load.exchange`` when the needs were
exchanged, ``load.read.file`` per file, ``load.read.io`` and ``load.checksum``: the readers'
thread-seconds in read calls and in checksums, ``load.transfer``, ``load.copy``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from ...coordination.base import Coordinator, run_stage
from ...format.dtypes import dtype_from_name
from ...format.records import Metadata
from ...monitoring.events import NO_EVENTS, EventBus
from ...planning.boxes import sub_box_is_contiguous
from ...planning.load.assign import ReadBatch, ReadPart, ShardKey, own_keys
from ...planning.load.overlap import CopyOp, ShardRead
from ...planning.load.runs import Placement, extents_of, place_need, whole_shard
from ...planning.specs import LoadItem
from ...storage.base import Storage
from ..bytes_view import box_view, sub_box, tensor_bytes
from .device import DeviceCopies
from .exchange import exchange_needs
from .forwarding import Transfer
from .reader import PIECE, Need, ReadClock, read_needs
from .schedule import BACKLOG, ReaderThreads

__all__ = ["read_stage"]


def read_stage(
    md: Metadata,
    storage: Storage,
    coord: Coordinator,
    items: list[LoadItem],
    reads: list[ShardRead],
    threads: int,
    verify: bool,
    dedup: bool | None,
    events: EventBus = NO_EVENTS,
    *,
    pinned_device_copies: bool = False,
    then: Callable[[], None] | None = None,
    one_cache: bool = False,
    kept: ReaderThreads | None = None,
) -> int:
    """Collective: read and place every needed shard; return the bytes this rank read.
    ``events``: the forwarding between ranks is reported as phase ``load.transfer``.
    ``pinned_device_copies`` (``ReadOptions``): CUDA destinations filled through the pinned
    bounce buffers and side streams of ``engine.load.device``. ``then``: more of this rank's work
    (the pipeline's blobs), run after its reads and before the stage's agreement, so that its
    failure is agreed on in the same round trip. ``kept``: the checkpointer's reader threads
    (``schedule.ReaderThreads``; None: the stage starts its own).

    Each rank reads, of each saved shard it needs, the rows its copies touch. With ``dedup``
    (and several ranks), a shard whose needed rows several ranks share is read by one of them
    only, whole, and forwarded over the process group to the others (``engine.load.exchange``);
    shards several ranks need in disjoint rows (a resharding load to another world size) are not
    forwarded: each rank reads its own rows. ``dedup=None`` forwards nothing when all ranks run
    on one host over storage that shares its page cache (local files): shared bytes are read
    through that cache (``read_into_cached``), so the device delivers each byte once; when the
    caller knows (``one_cache``: agreed by every rank in the load pipeline's describe stage) that
    every rank runs on one host and reads only through its page cache, no needs are exchanged
    at all. The
    batches of a rank that fails are sent too, marked bad, so nobody waits on them (module
    docstring for the order)."""
    me = coord.rank
    mine = {(r.fqn, r.shard_index): r for r in reads}
    t_exchange = time.perf_counter()
    part, exchanged = _assign(md, coord, mine, verify, dedup, one_cache, storage.capabilities.shared_page_cache)
    if exchanged:
        events.emit("load.exchange", me, t_exchange, path=storage.url)
    clock = ReadClock()  # thread-seconds in read calls and in checksums (monitoring)
    batches = list(part.batches or ())  # the coordinator's: shards others need too
    copies = _CopyClock()  # copies into place run on the reader threads, overlapping reads
    spans: dict[str, list[float]] = {}  # file -> [first piece start, last piece end, bytes]
    transfer = Transfer(coord, me, batches) if any(b.forwarded for b in batches) else None
    t_transfer = time.perf_counter()
    error: Exception | None = None
    total = 0
    device = (
        DeviceCopies.for_items((i.tensor for i in items), threads, PIECE, BACKLOG, copies.add)
        if pinned_device_copies
        else None
    )
    try:
        try:
            wanted, cached = _needs(md, items, mine, part, me, transfer, copies, device)
            total = read_needs(md, storage, wanted, cached, threads, verify, me, spans, copies.add, clock, device, kept)
        except Exception as e:  # agreed on below, after every transfer has completed
            error = e
        if transfer is not None:
            transfer.finish()  # sends what is still unsent (marked bad after a failure), waits for all
        total = run_stage(coord, "load (read)", lambda: _raise_or(error, total, then))
        if transfer is not None:
            t_apply = time.perf_counter()
            received = _place_received(md, items, mine, transfer, copies, device)
    finally:
        if device is not None:  # every host-to-device copy completed, the caller's stream after them
            device.finish()
    for name, (t0, t1, nbytes) in sorted(spans.items()):  # per-file read throughput (monitoring)
        events.emit("load.read.file", me, t0, path=name, nbytes=int(nbytes), end=t1)
    if clock.io_bytes:  # thread-seconds in read calls / checksums, overlapping each other
        detail = f"{clock.io:.6f} thread-seconds in read calls"
        events.emit("load.read.io", me, clock.first, end=clock.last, nbytes=clock.io_bytes, detail=detail)
    if clock.checksum_bytes:
        detail = f"{clock.checksum:.6f} thread-seconds verifying checksums, overlapped with the reads"
        events.emit("load.checksum", me, clock.first, end=clock.last, nbytes=clock.checksum_bytes, detail=detail)
    if transfer is not None:
        events.emit("load.transfer", me, t_transfer, path=storage.url, nbytes=received, end=t_apply)
    if copies.nbytes:  # the copies (host to host here; host to device for CUDA targets)
        detail = f"{copies.busy:.6f} thread-seconds of copying, overlapped with the reads"
        events.emit("load.copy", me, copies.first, end=copies.last, nbytes=copies.nbytes, detail=detail)
    return total


def _assign(
    md: Metadata,
    coord: Coordinator,
    mine: dict[ShardKey, ShardRead],
    verify: bool,
    dedup: bool | None,
    one_cache: bool,
    page_cache: bool,
) -> tuple[ReadPart, bool]:
    """Collective when several ranks deduplicate reads: this rank's part of the job's read
    assignment (``engine.load.exchange``), and whether the needs were exchanged for it; alone,
    or with nothing forwarded, it reads all it needs.

    ``dedup=None`` when every rank runs on one host and reads only through its page cache
    (``one_cache``, the same on every rank): the coordinator's rule would forward nothing and
    have each rank read all it needs, the shards others need too through the shared cache
    (``assign_reads``), so each rank takes that part itself, every shard through the cache,
    without the round trip."""
    if coord.world_size > 1 and dedup is not False:  # the coordinator assigns; each rank gets its part
        if dedup is None and one_cache:
            return ReadPart(None, shared=frozenset(mine)), False
        return exchange_needs(coord, md, mine.values(), dedup, page_cache, extents_of(md, verify)), True
    return ReadPart(None), False


def _needs(
    md: Metadata,
    items: list[LoadItem],
    mine: dict[ShardKey, ShardRead],
    part: ReadPart,
    me: int,
    transfer: Transfer | None,
    copies: _CopyClock,
    device: DeviceCopies | None,
) -> tuple[list[Need], set[int]]:
    """What this rank reads, in order: its own rows of the shards read apart, the batches it
    reads (for itself and others: forwarded ones into their send buffer), the shards it alone
    needs; and the indices of the needs read through the shared page cache."""
    shared, apart = part.shared, part.apart  # read through the shared cache / own rows only
    wanted: list[Need] = [_need(md, items, k, r, None, 0, copies, device) for k, r in mine.items() if k in apart]
    cached: set[int] = set()  # indices of needs read through the shared page cache
    for b in part.batches or ():
        if b.reader != me:
            continue
        out, sent = transfer.outgoing(b) if transfer is not None and b.forwarded else (None, None)
        for key, off in zip(b.keys, b.offsets):
            if key in shared:
                cached.add(len(wanted))
            wanted.append(_need(md, items, key, mine.get(key), out, off, copies, device, sent))
    for key in own_keys(me, mine, part):
        if key in shared:
            cached.add(len(wanted))
        wanted.append(_need(md, items, key, mine[key], None, 0, copies, device))
    return wanted, cached


def _raise_or(error: Exception | None, total: int, then: Callable[[], None] | None) -> int:
    """What this rank tells the stage's agreement: its failure, or (after ``then``, which may
    fail) the bytes it read."""
    if error is not None:
        raise error
    if then is not None:
        then()
    return total


def _place_received(
    md: Metadata,
    items: list[LoadItem],
    mine: dict[ShardKey, ShardRead],
    transfer: Transfer,
    copies: _CopyClock,
    device: DeviceCopies | None,
) -> int:
    """Copy the shards of every received batch into place (after the stage agreed that every
    reader succeeded); returns the bytes received."""

    def place(b: ReadBatch, payload: torch.Tensor) -> None:
        t0 = time.perf_counter()
        for key, off in zip(b.keys, b.offsets):
            _apply(md, items, mine[key], payload[off : off + mine[key].shard.byte_length], 0, device)
        copies.add(t0, time.perf_counter(), b.nbytes)

    return transfer.apply(place)


def _need(
    md: Metadata,
    items: list[LoadItem],
    key: ShardKey,
    r: ShardRead | None,
    buf: torch.Tensor | None,
    buf_offset: int,
    copies: _CopyClock,
    device: DeviceCopies | None,
    forwarded: Callable[[], None] | None = None,
) -> Need:
    """What this rank reads of saved shard ``key`` and where it lands (``place_need``): the whole
    shard into the forwarding buffer ``buf`` when it forwards it to other ranks (``forwarded()``
    once it is verified and placed here); else only the rows its copies ``r`` touch, straight
    into the destination when they are one contiguous region of it (through bounce buffers,
    ``Need.device``, when that region is on a CUDA device)."""
    if r is not None:
        shard, rb, rows = r.shard, r.row_bytes, r.rows
    else:  # a shard this rank reads for others only
        (shard, rb), rows = whole_shard(md, *key), None
    placed = place_need(shard, rb, rows, buf is not None)
    name, r0, r1, lo, hi = md.files[placed.file_index], placed.r0, placed.r1, placed.lo, placed.hi
    on_device: torch.Tensor | None = None
    if placed.placement is Placement.FORWARDED:
        assert buf is not None
        dest: torch.Tensor | None = buf[buf_offset : buf_offset + (hi - lo)]
    elif placed.placement is Placement.DIRECT:
        on_device = _device_target(md, items, r, r0, r1, device) if device is not None else None
        dest = _direct_target(md, items, r, r0, r1) if on_device is None else None
    else:  # small tensors are read with their neighbours into one temporary, then copied
        small = _direct_bytes(md, items, r, r0, r1) if forwarded is None else None
        if small is not None:  # the run copies the bytes there itself (Need.into): nothing to do after
            return Need(name, lo, hi, None, key[0], None, ((lo, small),))
        dest = None
    in_place = buf is None and dest is not None  # the bytes land where they belong: nothing to copy

    def done(region: torch.Tensor) -> None:
        if r is not None and not in_place:
            t0 = time.perf_counter()
            _apply(md, items, r, region, r0, device)
            copies.add(t0, time.perf_counter(), region.numel())
        if forwarded is not None:
            forwarded()

    return Need(name, lo, hi, done, key[0], dest, device=on_device)


class _CopyClock:
    """Span and total thread time of the copies into place of one read stage (``load.copy``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first, self.last, self.busy, self.nbytes = float("inf"), 0.0, 0.0, 0

    def add(self, t0: float, t1: float, nbytes: int) -> None:
        with self.lock:
            self.first, self.last = min(self.first, t0), max(self.last, t1)
            self.busy += t1 - t0
            self.nbytes += nbytes


def _direct_copy(
    md: Metadata, items: list[LoadItem], r: ShardRead | None, r0: int, r1: int, device: DeviceCopies | None = None
) -> tuple[torch.Tensor, CopyOp, bool] | None:
    """The destination, the one copy into it and whether that copy fills it, when rows
    ``[r0, r1)`` of the saved shard land whole in one contiguous CPU region (with ``device``:
    a region of a destination it fills, a CUDA tensor) of one destination without a dtype change."""
    if r is None or len(r.copies) != 1 or r1 <= r0:
        return None
    c = r.copies[0]
    lengths = r.shard.lengths
    if c.lengths != lengths:  # some rows: each whole, the copy starting at row r0
        if not lengths or c.lengths[1:] != lengths[1:] or c.src_offsets[0] != r0 or c.lengths[0] != r1 - r0:
            return None
    elif lengths and (c.src_offsets[0] != r0 or lengths[0] != r1 - r0):  # the whole box: all its rows
        return None
    dest = items[c.item_index].tensor
    if not (device.handles(dest) if device is not None else dest.is_cpu) or not dest.is_contiguous():
        return None
    if dest.dtype != dtype_from_name(md.tensors[r.fqn].dtype):  # cast while copying (cast_dtypes)
        return None
    if c.lengths == dest.shape and not any(c.dst_offsets):  # fills the destination (contiguous)
        return dest, c, True
    if not sub_box_is_contiguous(tuple(dest.shape), c.dst_offsets, c.lengths):
        return None
    return dest, c, False


def _direct_target(md: Metadata, items: list[LoadItem], r: ShardRead | None, r0: int, r1: int) -> torch.Tensor | None:
    """The destination memory itself (as bytes), when rows ``[r0, r1)`` of the saved shard land
    whole in one contiguous CPU region of one destination without a dtype change."""
    found = _direct_copy(md, items, r, r0, r1)
    if found is None:
        return None
    dest, c, _ = found
    return sub_box(dest, c.dst_offsets, c.lengths).reshape(-1).view(torch.uint8)


def _device_target(
    md: Metadata, items: list[LoadItem], r: ShardRead | None, r0: int, r1: int, device: DeviceCopies
) -> torch.Tensor | None:
    """``_direct_target`` for a CUDA destination (its bytes, on the device; ``Need.device``)."""
    found = _direct_copy(md, items, r, r0, r1, device)
    if found is None:
        return None
    dest, c, _ = found
    try:
        return sub_box(dest.detach(), c.dst_offsets, c.lengths).reshape(-1).view(torch.uint8)
    except RuntimeError:  # a dtype torch can not view as bytes: copied into place instead (``_apply``)
        return None


def _direct_bytes(md: Metadata, items: list[LoadItem], r: ShardRead | None, r0: int, r1: int) -> memoryview | None:
    """``_direct_target`` as a byte view (what a small need's bytes are copied into); the
    destination's own bytes when the copy fills it (no tensor views made)."""
    found = _direct_copy(md, items, r, r0, r1)
    if found is None:
        return None
    dest, c, whole = found
    if whole:
        return tensor_bytes(dest)
    return tensor_bytes(sub_box(dest, c.dst_offsets, c.lengths).reshape(-1).view(torch.uint8))


def _apply(
    md: Metadata, items: list[LoadItem], r: ShardRead, region: torch.Tensor, row0: int, device: DeviceCopies | None
) -> None:
    """Copy the pieces of one saved shard into their destinations; ``region``: the shard's raw
    bytes from row ``row0`` on (its first dimension), converting the dtype where the
    destination's differs (``LoadOptions.cast_dtypes``). A CUDA destination (``device``): the
    region is copied to its device once, on the side stream, and the copies run there."""
    dtype = dtype_from_name(md.tensors[r.fqn].dtype)
    lengths = r.shard.lengths
    shape = (region.numel() // max(1, r.row_bytes), *lengths[1:]) if lengths else ()
    src = box_view(region, dtype, shape)
    on_device: dict[torch.device, torch.Tensor] = {}  # the region copied to each CUDA device
    with torch.no_grad():
        for c in r.copies:
            offs = (c.src_offsets[0] - row0, *c.src_offsets[1:]) if c.src_offsets else ()
            live = items[c.item_index].tensor
            dest = sub_box(live, c.dst_offsets, c.lengths)
            if device is None or not device.handles(live):
                dest.copy_(sub_box(src, offs, c.lengths))
                continue
            with device.stream(live.device):
                there = on_device.get(live.device)
                if there is None:
                    there = on_device[live.device] = box_view(region.to(live.device), dtype, shape)
                dest.copy_(sub_box(there, offs, c.lengths))
