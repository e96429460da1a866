"""The load engine: metadata -> validation -> ranged parallel reads -> copies in place.

Call order (every rank; * = collective on the checkpoint group):
  ``read_metadata``*  rank 0 reads and validates the metadata, broadcasts the bytes; a missing
                      metadata file is told apart as an interrupted save or not a checkpoint;
  ``check_targets``   every problem with keys, shapes and dtypes, before any data I/O;
  ``plan_local_load`` which saved shards this rank needs and which sub-boxes go where;
  ``read_stage``*     needs gathered at the coordinator -> each needed saved shard assigned to
                      one reading rank, each rank sent its part (``engine.read_exchange``) ->
                      the bytes to read (the part of a shard this rank needs) grouped into runs ->
                      file sizes checked -> all runs read by one thread pool as parallel ranged
                      reads (straight into the destination when it is one contiguous region;
                      ``engine.read_runs``), each checksum unit verified as soon as its bytes
                      land and each need copied into place once its units are verified,
                      forwarded to the other ranks needing them;
  agreement*          every rank learns whether all ranks succeeded.
"""

from __future__ import annotations

import functools
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
    MissingDataFileError,
    SizeLimitError,
    TruncatedDataFileError,
)
from ..folder.probe import read_metadata_bytes
from ..format.checksums import ChunkChecksums, Units
from ..format.codec import decode_metadata
from ..format.dtypes import dtype_from_name, itemsize
from ..format.records import METADATA_FILE, BlobRecord, Metadata
from ..monitoring.events import NO_EVENTS, EventBus
from ..planning.boxes import sub_box_is_contiguous
from ..planning.byte_runs import MERGE_GAP, Run, Span, plan_runs, row_bytes
from ..planning.load_plan import CopyOp, ShardRead
from ..planning.read_assignment import ReadBatch
from ..planning.read_columns import Extents
from ..planning.specs import LoadItem
from ..storage.base import METADATA_LIMIT, Storage
from .bytes_view import box_view, sub_box, tensor_bytes
from .forwarding import Transfer
from .read_exchange import ReadPart, exchange_needs, own_keys, vectorized
from .read_runs import Need, RunJob

__all__ = ["read_metadata", "read_stage", "read_blob", "BLOB_LIMIT"]

BLOB_LIMIT = 1 << 30  # default cap of one extra_state / dataloader blob (LoadOptions.max_blob_bytes)


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


def _check_files(md: Metadata, storage: Storage, runs: list[Run], names: dict[int, str], rank: int) -> None:
    """Every file this rank reads exists and is long enough (from format version 3: at least
    its recorded size), before allocating anything."""
    need: dict[int, int] = {}
    for run in runs:
        need[run.file_index] = max(need.get(run.file_index, 0), run.hi)
    sums = md.checksums
    for fidx, end in need.items():
        name = md.files[fidx]
        recorded = sums.file_size(fidx) if sums is not None else None
        size = storage.size(name)
        if size is None:
            raise MissingDataFileError(
                f"rank {rank}: data file {storage.url}/{name} (holding {names.get(fidx, '?')!r}) is missing"
            )
        if recorded is not None and size < recorded:
            raise TruncatedDataFileError(
                f"rank {rank}: data file {storage.url}/{name} is truncated: {size} bytes, the metadata "
                f"records {recorded} (holding {names.get(fidx, '?')!r})"
            )
        if size < end:
            raise TruncatedDataFileError(
                f"rank {rank}: data file {storage.url}/{name} is truncated: {size} bytes, "
                f"but {names.get(fidx, '?')!r} needs bytes up to {end}"
            )


def _extent(md: Metadata, verify: bool) -> Callable[[int, int, int], tuple[int, int]]:
    """The bytes a read of ``[lo, hi)`` of a file covers (its checksum units)."""
    if verify and isinstance(md.checksums, ChunkChecksums):
        return md.checksums.extent  # chunk arithmetic, no unit list
    cover = _cover(md, verify)

    def extent(f: int, lo: int, hi: int) -> tuple[int, int]:
        units = cover(f, lo, hi)
        return units.lo, units.hi

    return extent


def _extents(md: Metadata, verify: bool) -> Extents:
    """``_extent`` over arrays (the coordinator's read assignment): the chunk checksums' own
    vectorised arithmetic, else ``_extent`` one range at a time."""
    if verify and isinstance(md.checksums, ChunkChecksums):
        return md.checksums.extents
    return vectorized(_extent(md, verify))


def _cover(md: Metadata, verify: bool) -> Callable[[int, int, int], Units]:
    """The checksum units covering a byte range (none when not verifying, or for metadata
    without checksums: then exactly the range is read)."""
    sums = md.checksums
    if not verify or sums is None:
        return lambda f, lo, hi: Units((), (), (), lo, hi)
    return sums.cover


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

    Each rank reads, of each saved shard it needs, the rows its copies touch. With ``dedup``
    (and several ranks), a shard whose needed rows several ranks share is read by one of them
    only, whole, and forwarded over the process group to the others (``read_exchange``); shards
    several ranks need in disjoint rows (a resharding load to another world size) are not
    forwarded: each rank reads its own rows. ``dedup=None`` forwards nothing when all ranks run
    on one host over storage that shares its page cache (local files): shared bytes are read
    through that cache (``read_into_cached``), so the device delivers each byte once.
    Order: every rank's needs gathered at the coordinator, which assigns the reads and sends each
    rank its own part (``read_exchange``) -> receives posted -> every rank reads its runs
    (``_read_runs``), sending each forwarded batch the moment its last shard is verified (the
    batches of a rank that fails are sent too, marked bad, so nobody waits on them) -> every
    transfer completes -> all ranks agree the reads succeeded -> received batches copied into
    place."""
    me = coord.rank
    mine = {(r.fqn, r.shard_index): r for r in reads}
    part = ReadPart(None)  # alone, or nothing forwarded: this rank reads all it needs
    if coord.world_size > 1 and dedup is not False:  # the coordinator assigns; each rank gets its part
        part = exchange_needs(
            coord, md, mine.values(), dedup, storage.capabilities.shared_page_cache, _extents(md, verify)
        )
    shared, apart = part.shared, part.apart  # read through the shared cache / own rows only
    batches = list(part.batches or ())  # the coordinator's: shards others need too
    own = own_keys(me, mine, part)  # the shards this rank alone needs
    reading = [b for b in batches if b.reader == me]
    copies = _CopyClock()  # copies into place run on the reader threads, overlapping reads
    spans: dict[str, list[float]] = {}  # file -> [first piece start, last piece end, bytes]
    forwarding = any(b.forwarded for b in batches)
    transfer = Transfer(coord, me, batches) if forwarding else None
    t_transfer = time.perf_counter()

    def read_mine() -> int:
        wanted: list[Need] = [_need(md, items, k, r, None, 0, copies) for k, r in mine.items() if k in apart]
        cached: set[int] = set()  # indices of needs read through the shared page cache
        for b in reading:
            out, sent = transfer.outgoing(b) if transfer is not None and b.forwarded else (None, None)
            for key, off in zip(b.keys, b.offsets):
                if key in shared:
                    cached.add(len(wanted))
                wanted.append(_need(md, items, key, mine.get(key), out, off, copies, sent))
        for key in own:
            if key in shared:
                cached.add(len(wanted))
            wanted.append(_need(md, items, key, mine[key], None, 0, copies))
        return _read_runs(md, storage, wanted, cached, threads, verify, me, spans, copies)

    error: Exception | None = None
    total = 0
    try:
        total = read_mine()
    except Exception as e:  # agreed on below, after every transfer has completed
        error = e
    if transfer is not None:
        transfer.finish()  # sends what is still unsent (marked bad after a failure), waits for all

    def agreed() -> int:
        if error is not None:
            raise error
        return total

    total = run_stage(coord, "load (read)", agreed)
    for name, (t0, t1, nbytes) in sorted(spans.items()):  # per-file read throughput (monitoring)
        events.emit("load.read.file", me, t0, path=name, nbytes=int(nbytes), end=t1)
    if transfer is not None:
        t_apply = time.perf_counter()

        def place(b: ReadBatch, payload: torch.Tensor) -> None:
            t0 = time.perf_counter()
            for key, off in zip(b.keys, b.offsets):
                _apply(md, items, mine[key], payload[off : off + mine[key].shard.byte_length], 0)
            copies.add(t0, time.perf_counter(), b.nbytes)

        received = transfer.apply(place)
        events.emit("load.transfer", me, t_transfer, path=storage.url, nbytes=received, end=t_apply)
    if copies.nbytes:  # the copies (host to host here; host to device for CUDA targets)
        detail = f"{copies.busy:.6f} thread-seconds of copying, overlapped with the reads"
        events.emit("load.copy", me, copies.first, end=copies.last, nbytes=copies.nbytes, detail=detail)
    return total


def _need(
    md: Metadata,
    items: list[LoadItem],
    key: tuple[str, int],
    r: ShardRead | None,
    buf: torch.Tensor | None,
    buf_offset: int,
    copies: _CopyClock,
    forwarded: Callable[[], None] | None = None,
) -> Need:
    """What this rank reads of saved shard ``key`` and where it lands: the whole shard into the
    forwarding buffer ``buf`` when it forwards it to other ranks (``forwarded()`` once it is
    verified and placed here); else only the rows its copies ``r`` touch, straight into the
    destination when they are one contiguous region of it."""
    if r is not None:
        shard, rb = r.shard, r.row_bytes
    else:  # a shard this rank reads for others only
        rec = md.tensors[key[0]]
        shard = rec.shards[key[1]]
        rb = row_bytes(shard.lengths, itemsize(rec.dtype))
    name = md.files[shard.file_index]
    if buf is not None or r is None:
        r0, r1 = 0, (shard.lengths[0] if shard.lengths else 1)
    else:
        r0, r1 = r.rows
    lo, hi = shard.byte_offset + r0 * rb, shard.byte_offset + r1 * rb
    if buf is not None:
        dest: torch.Tensor | None = buf[buf_offset : buf_offset + (hi - lo)]
    elif hi - lo >= _DIRECT_MIN:
        dest = _direct_target(md, items, r, r0, r1)
    else:  # small tensors are read with their neighbours into one temporary, then copied
        small = _direct_bytes(md, items, r, r0, r1) if forwarded is None else None
        if small is not None:  # the run copies the bytes there itself (Need.into): nothing to do after
            return Need(name, lo, hi, None, key[0], None, ((lo, small),))
        dest = None
    in_place = buf is None and dest is not None  # the bytes land where they belong: nothing to copy

    def done(region: torch.Tensor) -> None:
        if r is not None and not in_place:
            t0 = time.perf_counter()
            _apply(md, items, r, region, r0)
            copies.add(t0, time.perf_counter(), region.numel())
        if forwarded is not None:
            forwarded()

    return Need(name, lo, hi, done, key[0], dest)


def _read_runs(
    md: Metadata,
    storage: Storage,
    wanted: list[Need],
    cached: set[int],
    threads: int,
    verify: bool,
    rank: int,
    spans: dict[str, list[float]],
    copies: _CopyClock,
) -> int:
    """Read every need of this rank: spans -> runs (``planning.byte_runs``) -> one reader pool
    over the pieces of all runs; returns the bytes read. ``copies`` times the runs' copies of
    small needs into place (``Need.into``)."""
    cover = _cover(md, verify)
    index = {f: i for i, f in enumerate(md.files)}
    names = {index[n.name]: n.what for n in wanted}
    wanted, cached = _group_small(wanted, cached)
    tagged = [Span(index[n.name], n.lo, n.hi, t) for t, n in enumerate(wanted)]

    runs = plan_runs(tagged, _extent(md, verify))
    _check_files(md, storage, runs, names, rank)
    lock = threading.Lock()
    jobs = []
    for run in runs:
        read = storage.read_into_cached if any(t in cached for t in run.tags) else storage.read_into
        units = cover(run.file_index, run.lo, run.hi)
        holders = functools.partial(_holders, md, run.file_index)
        needs = [wanted[t] for t in run.tags]
        name = md.files[run.file_index]
        jobs.append(RunJob(run, name, needs, units, read, verify, storage.url, rank, holders, copied=copies.add))

    def piece(job: RunJob, p: int, n: int) -> None:
        t0 = time.perf_counter()
        job.read_piece(p)
        t1 = time.perf_counter()
        with lock:
            span = spans.setdefault(job.name, [t0, t1, 0])
            span[0], span[1], span[2] = min(span[0], t0), max(span[1], t1), span[2] + n

    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="unickpt-read")
    try:
        futures = []
        for job in jobs:
            job.start()
            futures += [pool.submit(piece, job, p, hi - lo) for p, (lo, hi) in enumerate(job.pieces())]
        for f in futures:
            f.result()
    finally:  # after a failure: drop the pieces not started yet
        pool.shutdown(wait=True, cancel_futures=True)
    return sum(job.nbytes for job in jobs)


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


_DIRECT_MIN = 256 << 10  # needs at least this large are read straight into their destination


def _direct_copy(
    md: Metadata, items: list[LoadItem], r: ShardRead | None, r0: int, r1: int
) -> tuple[torch.Tensor, CopyOp, bool] | None:
    """The destination, the one copy into it and whether that copy fills it, when rows
    ``[r0, r1)`` of the saved shard land whole in one contiguous CPU region of one destination
    without a dtype change."""
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
    if not dest.is_cpu or not dest.is_contiguous():
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


def _apply(md: Metadata, items: list[LoadItem], r: ShardRead, region: torch.Tensor, row0: int) -> None:
    """Copy the pieces of one saved shard into their destinations; ``region``: the shard's raw
    bytes from row ``row0`` on (its first dimension), converting the dtype where the
    destination's differs (``LoadOptions.cast_dtypes``)."""
    dtype = dtype_from_name(md.tensors[r.fqn].dtype)
    lengths = r.shard.lengths
    if lengths:
        rows = region.numel() // max(1, r.row_bytes)
        src = box_view(region, dtype, (rows, *lengths[1:]))
    else:
        src = box_view(region, dtype, ())
    with torch.no_grad():
        for c in r.copies:
            offs = (c.src_offsets[0] - row0, *c.src_offsets[1:]) if c.src_offsets else ()
            dest = sub_box(items[c.item_index].tensor, c.dst_offsets, c.lengths)
            dest.copy_(sub_box(src, offs, c.lengths))


def read_blob(md: Metadata, storage: Storage, blob: BlobRecord, rank: int, cap: int = BLOB_LIMIT) -> bytes:
    """The bytes of ``blob``, checksum-verified; refused before allocating when over ``cap``.

    The allocation is bounded by the file's size and by ``cap`` (plus the checksum chunks at its
    ends), not by the blocks the file occupies (st_blocks): filesystems that compress or
    deduplicate (btrfs, ZFS) and network filesystems report fewer blocks than a legitimate file
    holds, so a block count would refuse good checkpoints. A sparse file within the cap costs at
    most ``cap`` bytes of memory and then fails its checksum."""
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
    lo, hi = blob.byte_offset, blob.byte_offset + blob.byte_length
    units = _cover(md, True)(blob.file_index, lo, hi)
    if units.hi > size:
        raise TruncatedDataFileError(f"rank {rank}: data file {storage.url}/{name} is truncated ({blob.key!r})")
    out = bytearray(units.hi - units.lo)
    storage.read_into(name, units.lo, memoryview(out))
    for start, end, want in zip(units.starts, units.ends, units.crcs):
        if crc32c.crc32c(memoryview(out)[start - units.lo : end - units.lo]) != want:
            raise ChecksumMismatchError(
                f"rank {rank}: checksum mismatch for {blob.key!r} in {storage.url}/{name} bytes [{start}, {end})"
            )
    return bytes(out[lo - units.lo : hi - units.lo])
