"""The load engine: metadata -> validation -> ranged parallel reads -> copies in place.

Call order (every rank; * = collective on the checkpoint group):
  ``read_metadata``*  rank 0 reads and validates the metadata, broadcasts the bytes; a missing
                      metadata file is told apart as an interrupted save or not a checkpoint;
  ``check_targets``   every problem with keys, shapes and dtypes, before any data I/O;
  ``plan_local_load`` which saved shards this rank needs and which sub-boxes go where;
  ``read_stage``*     needs gathered -> each needed saved shard assigned to one reading rank ->
                      file sizes checked -> all shards read by one thread pool as parallel ranged
                      reads (straight into the destination when it is one contiguous region),
                      each CRC32C-verified and copied into place as soon as its last chunk lands,
                      forwarded to the other ranks needing them;
  agreement*          every rank learns whether all ranks succeeded.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch

from ..coordination.base import Coordinator, run_stage
from ..errors import (
    CheckpointError,
    ChecksumMismatchError,
    IncompleteCheckpointError,
    MissingDataFileError,
    NotACheckpointError,
    SizeLimitError,
    TruncatedDataFileError,
)
from ..format.codec import decode_metadata
from ..format.dtypes import dtype_from_name
from ..format.records import DATA_DIR, METADATA_FILE, BlobRecord, Metadata
from ..monitoring.events import NO_EVENTS, EventBus
from ..planning.boxes import sub_box_is_contiguous
from ..planning.load_plan import ShardRead
from ..planning.read_assignment import ReadBatch, assign_reads
from ..planning.specs import LoadItem
from ..storage.base import METADATA_LIMIT, Storage
from ..storage.commit import publisher_for
from .bytes_view import box_view, sub_box, tensor_bytes
from .folder_hint import folder_hint

__all__ = ["read_metadata", "read_metadata_bytes", "read_stage", "read_blob", "BLOB_LIMIT"]

BLOB_LIMIT = 1 << 30  # default cap of one extra_state / dataloader blob (LoadOptions.max_blob_bytes)


def read_metadata_bytes(storage: Storage, limit: int = METADATA_LIMIT) -> bytes:
    """The raw metadata bytes of the checkpoint in ``storage`` (one process, no collective).

    A missing metadata file is told apart: data files present -> IncompleteCheckpointError (an
    interrupted save), nothing -> NotACheckpointError. Only a regular file of at most ``limit``
    bytes is read (``SizeLimitError`` / ``UnsafePathError``). Used by ``read_metadata`` and the tools."""
    try:
        data = publisher_for(storage).read(METADATA_FILE, limit)
    except SizeLimitError as e:
        raise SizeLimitError(
            f"{e} (the metadata cap: LoadOptions(max_metadata_bytes=...) raises it for a larger checkpoint)"
        ) from None
    if data is not None:
        return data
    if storage.list(DATA_DIR + "/"):
        raise IncompleteCheckpointError(
            f"{storage.url} is an incomplete checkpoint: data files exist but {METADATA_FILE} was "
            "never committed (the save was interrupted); it cannot be loaded"
        )
    raise NotACheckpointError(f"{storage.url} is not a unickpt checkpoint (no {METADATA_FILE}){folder_hint(storage)}")


def read_metadata(coord: Coordinator, storage: Storage, limit: int = METADATA_LIMIT) -> Metadata:
    """Collective: rank 0 reads (at most ``limit`` bytes), everyone decodes the same bytes."""
    if coord.world_size == 1:
        return decode_metadata(read_metadata_bytes(storage, limit), f"{storage.url}/{METADATA_FILE}")
    payload: object = None
    if coord.rank == 0:
        try:
            payload = read_metadata_bytes(storage, limit)
        except CheckpointError as e:
            payload = e
    payload = coord.broadcast_object(payload)
    if isinstance(payload, CheckpointError):
        raise payload
    assert isinstance(payload, bytes)
    return decode_metadata(payload, f"{storage.url}/{METADATA_FILE}")


def _check_files(md: Metadata, storage: Storage, reads: list[ShardRead], rank: int) -> None:
    """Every file this rank reads exists and is long enough, before allocating anything."""
    need: dict[int, tuple[int, str]] = {}
    for r in reads:
        s = md.tensors[r.fqn].shards[r.shard_index]
        end = s.window.byte_offset + s.window.byte_length if s.window is not None else s.byte_offset + s.byte_length
        if end > need.get(s.file_index, (0, ""))[0]:
            need[s.file_index] = (end, r.fqn)
    for fidx, (end, fqn) in need.items():
        name = md.files[fidx]
        size = storage.size(name)
        if size is None:
            raise MissingDataFileError(f"rank {rank}: data file {storage.url}/{name} (holding {fqn!r}) is missing")
        if size < end:
            raise TruncatedDataFileError(
                f"rank {rank}: data file {storage.url}/{name} is truncated: {size} bytes, "
                f"but {fqn!r} needs bytes up to {end}"
            )


_CHUNK = 16 << 20  # shards are read as parallel ranged reads cut at multiples of this file offset


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
) -> int:
    """Collective: read and place every needed shard; return the bytes this rank read.
    ``events``: the forwarding between ranks is reported as phase ``load.transfer``.

    With ``dedup`` (and several ranks) each needed saved shard is read by one rank only and
    forwarded over the process group to the other ranks that need it (``assign_reads``);
    ``dedup=None`` does that unless all ranks run on one host over storage that shares its page
    cache (local files), where shards several ranks need are read through that cache
    (``read_into_cached``) so the device delivers each byte once.
    Order: gather needs -> every rank reads its shards (one pipeline: parallel ranged reads,
    each shard checksummed and copied into place by the thread finishing its last chunk) ->
    all ranks agree the reads succeeded (so nobody waits forever on a failed peer) ->
    receives posted, batches sent, pieces copied into place as they arrive."""
    me = coord.rank
    mine = {(r.fqn, r.shard_index): r for r in reads}
    shared: set[tuple[str, int]] = set()
    if coord.world_size > 1 and dedup is not False:
        gathered = coord.all_gather_object((socket.gethostname(), list(mine)))
        hosts = {h for h, _ in gathered}
        # auto: ranks of one host reading local files share its page cache, which already reads
        # each byte from the device once; forwarding pays off across hosts or for remote storage
        if dedup is None and len(hosts) == 1 and storage.capabilities.shared_page_cache:
            others = {k for r, (_, n) in enumerate(gathered) if r != me for k in n}
            shared = others & set(mine)
            gathered = [(h, n if r == me else []) for r, (h, n) in enumerate(gathered)]
        needs = [n for _, n in gathered]
    else:
        needs = [[] for _ in range(coord.world_size)]
        needs[me] = list(mine)
    batches = assign_reads(md, needs)
    reading = [b for b in batches if b.reader == me]
    outgoing: list[tuple[ReadBatch, torch.Tensor]] = []

    copies = _CopyClock()  # copies into place run on the reader threads, overlapping reads
    spans: dict[str, list[float]] = {}  # file -> [first chunk start, last chunk end, bytes]
    spans_lock = threading.Lock()

    def timed_chunk(job: _ShardJob, lo: int, n: int) -> None:
        t0 = time.perf_counter()
        job.read_chunk(lo, n)
        t1 = time.perf_counter()
        with spans_lock:
            span = spans.setdefault(job.name, [t0, t1, 0])
            span[0], span[1], span[2] = min(span[0], t0), max(span[1], t1), span[2] + n

    def read_mine() -> int:
        _check_files(md, storage, [mine.get(k) or ShardRead(k[0], k[1], ()) for b in reading for k in b.keys], me)
        cached = storage.read_into_cached
        pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="unickpt-read")
        try:
            futures, total = [], 0
            for b in reading:
                buf = torch.empty(b.nbytes, dtype=torch.uint8) if len(b.consumers) > 1 else None
                if buf is not None:
                    outgoing.append((b, buf))
                for key, off in zip(b.keys, b.offsets):
                    job = _ShardJob(
                        md,
                        storage,
                        items,
                        mine,
                        key,
                        buf,
                        off,
                        verify,
                        me,
                        cached if key in shared else storage.read_into,
                    )
                    job.copies = copies
                    if not job.pieces:  # an empty shard: nothing to read, still checked and placed
                        job.finish()
                    futures += [pool.submit(timed_chunk, job, lo, n) for lo, n in job.pieces]
                    total += job.read_length
            for f in futures:
                f.result()
            return total
        finally:  # after a failure: drop the chunks not started yet
            pool.shutdown(wait=True, cancel_futures=True)

    total = run_stage(coord, "load (read)", read_mine)
    for name, (t0, t1, nbytes) in sorted(spans.items()):  # per-file read throughput (monitoring)
        events.emit("load.read.file", me, t0, path=name, nbytes=int(nbytes), end=t1)
    if copies.nbytes:  # the copies (host to host here; host to device for CUDA targets)
        detail = f"{copies.busy:.6f} thread-seconds of copying, overlapped with the reads"
        events.emit("load.copy", me, copies.first, end=copies.last, nbytes=copies.nbytes, detail=detail)
    if coord.world_size == 1 or not any(len(b.consumers) > 1 for b in batches):
        return total
    with events.phase("load.transfer", me, path=storage.url) as phase:
        phase.nbytes = _forward(md, items, mine, batches, outgoing, coord, me)
    return total


def _forward(
    md: Metadata,
    items: list[LoadItem],
    mine: dict[tuple[str, int], ShardRead],
    batches: list[ReadBatch],
    outgoing: list[tuple[ReadBatch, torch.Tensor]],
    coord: Coordinator,
    me: int,
) -> int:
    """Send the batches this rank read for others, receive and place those it needs; returns
    the bytes received."""
    received = 0
    recvs = []
    for b in batches:
        if b.reader != me and me in b.consumers:
            buf = torch.empty(b.nbytes, dtype=torch.uint8)
            recvs.append((b, buf, coord.irecv(buf, b.reader, b.batch_id)))
    sends = [coord.isend(buf, dst, b.batch_id) for b, buf in outgoing for dst in b.consumers if dst != me]
    for b, buf, work in recvs:
        work.wait()
        received += b.nbytes
        for key, off in zip(b.keys, b.offsets):
            _apply(md, items, mine[key], buf[off : off + md.tensors[key[0]].shards[key[1]].byte_length])
    for w in sends:
        w.wait()
    return received


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


class _ShardJob:
    """One saved shard this rank reads: ``read_chunk`` calls run on the reader pool (any order,
    in parallel); the call finishing the last chunk verifies the checksum and copies this rank's
    pieces into place, so checksums and copies overlap the reads of other chunks.

    The bytes land in the destination tensor itself when the shard is one contiguous region of
    it, else in the forwarding batch buffer ``buf`` (shards other ranks need too), else in a
    temporary allocated when the first chunk starts and dropped once the copies are done.
    Every such size is bounded before any allocation: a shard lies inside its tensor's global
    shape, which ``check_targets`` validated against the live state (and the codec checked its
    byte length against its box and dtype), so metadata cannot make a temporary larger than a
    tensor the job itself holds (globally)."""

    def __init__(
        self,
        md: Metadata,
        storage: Storage,
        items: list[LoadItem],
        mine: dict[tuple[str, int], ShardRead],
        key: tuple[str, int],
        buf: torch.Tensor | None,
        buf_offset: int,
        verify: bool,
        rank: int,
        read_into: Callable[[str, int, memoryview], None],
    ) -> None:
        self.md, self.storage, self.items, self.key = md, storage, items, key
        self.mine, self.verify, self.rank, self.read_into = mine.get(key), verify, rank, read_into
        self.shard = md.tensors[key[0]].shards[key[1]]
        self.name = md.files[self.shard.file_index]
        n = self.shard.byte_length
        # a derived shard that is part of a saved one (format.transforms): the whole saved shard
        # is read into a temporary and verified, then the part is used
        window = self.shard.window
        self.read_offset = window.byte_offset if window is not None else self.shard.byte_offset
        self.read_length = window.byte_length if window is not None else n
        self.crc32c = window.crc32c if window is not None else self.shard.crc32c
        self.part_offset = self.shard.byte_offset - self.read_offset
        self.buf_region = buf[buf_offset : buf_offset + n] if buf is not None else None
        self.region: torch.Tensor | None = None  # where the bytes land when not the destination
        self.view: memoryview | None = None
        if window is None:
            if buf is not None:
                self.region = self.buf_region
            else:
                self.view = _direct_target(md, items, self.mine)
            if self.region is not None:
                self.view = tensor_bytes(self.region)
        self.pieces = self._pieces()
        self.left = len(self.pieces)
        self._lock = threading.Lock()
        self.copies: _CopyClock | None = None  # set by read_stage: time of the copies into place

    def _pieces(self) -> list[tuple[int, int]]:
        """(offset in the shard, length) pieces, cut where the file offset crosses a _CHUNK line."""
        out, start, n = [], self.read_offset, self.read_length
        pos = start
        while pos < start + n:
            nxt = min(start + n, (pos // _CHUNK + 1) * _CHUNK)
            out.append((pos - start, nxt - pos))
            pos = nxt
        return out

    def _target(self) -> memoryview:
        with self._lock:
            if self.view is None:  # first chunk to run allocates the temporary
                self.region = torch.empty(self.read_length, dtype=torch.uint8)
                self.view = tensor_bytes(self.region)
            return self.view

    def read_chunk(self, lo: int, n: int) -> None:
        self.read_into(self.name, self.read_offset + lo, self._target()[lo : lo + n])
        with self._lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.finish()

    def finish(self) -> None:
        view = self._target()
        if self.verify:
            _verify(self.md, self.storage, self.key, view, self.rank, self.crc32c, self.read_offset)
        if self.shard.window is not None and self.region is not None:  # the part of the saved shard
            part = self.region[self.part_offset : self.part_offset + self.shard.byte_length]
            if self.buf_region is not None:
                self.buf_region.copy_(part)  # forwarded to the other ranks that need it
            self.region = part
        if self.region is not None and self.mine is not None:
            t0 = time.perf_counter()
            _apply(self.md, self.items, self.mine, self.region)
            if self.copies is not None:
                self.copies.add(t0, time.perf_counter(), self.shard.byte_length)
        self.region = None
        self.view = memoryview(b"")  # the temporary (if any) is freed now


def _direct_target(md: Metadata, items: list[LoadItem], r: ShardRead | None) -> memoryview | None:
    """The destination memory itself, when the shard lands whole in one contiguous CPU region."""
    if r is None or len(r.copies) != 1:
        return None
    c = r.copies[0]
    shard = md.tensors[r.fqn].shards[r.shard_index]
    dest = items[c.item_index].tensor
    if c.lengths != shard.lengths or dest.device.type != "cpu" or not dest.is_contiguous():
        return None
    if dest.dtype != dtype_from_name(md.tensors[r.fqn].dtype):  # cast while copying (cast_dtypes)
        return None
    if not sub_box_is_contiguous(tuple(dest.shape), c.dst_offsets, c.lengths):
        return None
    return tensor_bytes(sub_box(dest, c.dst_offsets, c.lengths)) if shard.byte_length else None


def _verify(
    md: Metadata, storage: Storage, key: tuple[str, int], view: memoryview, rank: int, want: int, at: int
) -> None:
    """``view`` (the bytes read from ``at``) against the stored checksum ``want``."""
    shard = md.tensors[key[0]].shards[key[1]]
    got = crc32c.crc32c(view)
    if got != want:
        raise ChecksumMismatchError(
            f"rank {rank}: checksum mismatch for {key[0]!r} shard offsets={shard.offsets} "
            f"lengths={shard.lengths} in {storage.url}/{md.files[shard.file_index]} at byte "
            f"{at}: stored {want:#010x}, read {got:#010x} (the file is corrupt)"
        )


def _apply(md: Metadata, items: list[LoadItem], r: ShardRead, region: torch.Tensor) -> None:
    """Copy the pieces of one saved shard (raw bytes in ``region``) into their destinations,
    converting the dtype where the destination's differs (``LoadOptions.cast_dtypes``)."""
    rec = md.tensors[r.fqn]
    shard = rec.shards[r.shard_index]
    src = box_view(region, dtype_from_name(rec.dtype), shard.lengths)
    with torch.no_grad():
        for c in r.copies:
            dest = sub_box(items[c.item_index].tensor, c.dst_offsets, c.lengths)
            dest.copy_(sub_box(src, c.src_offsets, c.lengths))


def read_blob(md: Metadata, storage: Storage, blob: BlobRecord, rank: int, cap: int = BLOB_LIMIT) -> bytes:
    """The bytes of ``blob``, checksum-verified; refused before allocating when over ``cap``.

    The allocation is bounded by the file's size and by ``cap``, not by the blocks the file
    occupies (st_blocks): filesystems that compress or deduplicate (btrfs, ZFS) and network
    filesystems report fewer blocks than a legitimate file holds, so a block count would refuse
    good checkpoints. A sparse file within the cap costs at most ``cap`` bytes of memory and
    then fails its checksum."""
    name = md.files[blob.file_index]
    size = storage.size(name)
    if size is None:
        raise MissingDataFileError(f"rank {rank}: data file {storage.url}/{name} (holding {blob.key!r}) is missing")
    if size < blob.byte_offset + blob.byte_length:
        raise TruncatedDataFileError(f"rank {rank}: data file {storage.url}/{name} is truncated ({blob.key!r})")
    if blob.byte_length > cap:
        raise SizeLimitError(
            f"rank {rank}: blob {blob.key!r} in {storage.url}/{name} claims {blob.byte_length} bytes, over the "
            f"cap of {cap} bytes per blob; refused before allocating it (LoadOptions(max_blob_bytes=...) "
            "raises the cap for a checkpoint you trust)"
        )
    out = bytearray(blob.byte_length)
    storage.read_into(name, blob.byte_offset, memoryview(out))
    if crc32c.crc32c(out) != blob.crc32c:
        raise ChecksumMismatchError(f"rank {rank}: checksum mismatch for {blob.key!r} in {storage.url}/{name}")
    return bytes(out)
