"""The load engine: metadata -> validation -> ranged parallel reads -> copies in place.

Call order (every rank; * = collective on the checkpoint group):
  ``read_metadata``*  rank 0 reads and validates the metadata, broadcasts the bytes; a missing
                      metadata file is told apart as an interrupted save or not a checkpoint;
  ``check_targets``   every problem with keys, shapes and dtypes, before any data I/O;
  ``plan_local_load`` which saved shards this rank needs and which sub-boxes go where;
  ``read_stage``*     needs gathered -> each needed saved shard assigned to one reading rank ->
                      file sizes checked -> whole shards read by a thread pool as parallel ranged
                      reads (straight into the destination when it is one contiguous region),
                      CRC32C verified, forwarded to the other ranks needing them, sub-boxes copied;
  agreement*          every rank learns whether all ranks succeeded.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch

from ..coordination.base import Coordinator, run_stage
from ..errors import (
    ChecksumMismatchError,
    CheckpointError,
    IncompleteCheckpointError,
    MissingDataFileError,
    NotACheckpointError,
    TruncatedDataFileError,
)
from ..format.codec import decode_metadata
from ..format.dtypes import dtype_from_name
from ..format.records import DATA_DIR, METADATA_FILE, BlobRecord, Metadata
from ..planning.boxes import sub_box_is_contiguous
from ..planning.load_plan import ShardRead
from ..planning.read_assignment import ReadBatch, assign_reads
from ..planning.specs import LoadItem
from ..storage.base import Storage
from .bytes_view import box_view, sub_box, tensor_bytes

__all__ = ["read_metadata", "read_metadata_bytes", "read_stage", "read_blob"]


def read_metadata_bytes(storage: Storage) -> bytes:
    """The raw metadata bytes of the checkpoint in ``storage`` (one process, no collective).

    A missing metadata file is told apart: data files present -> IncompleteCheckpointError (an
    interrupted save), nothing -> NotACheckpointError. Used by ``read_metadata`` and the tools."""
    data = storage.read(METADATA_FILE)
    if data is not None:
        return data
    if storage.list(DATA_DIR + "/"):
        raise IncompleteCheckpointError(
            f"{storage.url} is an incomplete checkpoint: data files exist but {METADATA_FILE} was "
            "never committed (the save was interrupted); it cannot be loaded"
        )
    raise NotACheckpointError(f"{storage.url} is not a unickpt checkpoint (no {METADATA_FILE})")


def read_metadata(coord: Coordinator, storage: Storage) -> Metadata:
    """Collective: rank 0 reads, everyone decodes the same bytes."""
    if coord.world_size == 1:
        return decode_metadata(read_metadata_bytes(storage), f"{storage.url}/{METADATA_FILE}")
    payload: object = None
    if coord.rank == 0:
        try:
            payload = read_metadata_bytes(storage)
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
        end = s.byte_offset + s.byte_length
        if end > need.get(s.file_index, (0, ""))[0]:
            need[s.file_index] = (end, r.fqn)
    for fidx, (end, fqn) in need.items():
        name = md.files[fidx]
        size = storage.size(name)
        if size is None:
            raise MissingDataFileError(
                f"rank {rank}: data file {storage.url}/{name} (holding {fqn!r}) is missing")
        if size < end:
            raise TruncatedDataFileError(
                f"rank {rank}: data file {storage.url}/{name} is truncated: {size} bytes, "
                f"but {fqn!r} needs bytes up to {end}")


_CHUNK = 16 << 20  # large shards are read as parallel ranged reads of this size


def read_stage(md: Metadata, storage: Storage, coord: Coordinator, items: list[LoadItem],
               reads: list[ShardRead], threads: int, verify: bool, dedup: bool | None) -> int:
    """Collective: read and place every needed shard; return the bytes this rank read.

    With ``dedup`` (and several ranks) each needed saved shard is read by one rank only and
    forwarded over the process group to the other ranks that need it (``assign_reads``);
    ``dedup=None`` does that unless all ranks run on one host over storage that shares its page
    cache (local files), where the kernel already fetches each byte from the device once.
    Order: gather needs -> every rank reads its batches (parallel ranged reads, checksums) ->
    all ranks agree the reads succeeded (so nobody waits forever on a failed peer) ->
    receives posted, batches sent, pieces copied into place as they arrive."""
    me = coord.rank
    mine = {(r.fqn, r.shard_index): r for r in reads}
    if coord.world_size > 1 and dedup is not False:
        gathered = coord.all_gather_object((socket.gethostname(), list(mine)))
        hosts = {h for h, _ in gathered}
        # auto: ranks of one host reading local files share its page cache, which already reads
        # each byte from the device once; forwarding pays off across hosts or for remote storage
        if dedup is None and len(hosts) == 1 and getattr(storage, "shared_page_cache", False):
            gathered = [(h, n if r == me else []) for r, (h, n) in enumerate(gathered)]
        needs = [n for _, n in gathered]
    else:
        needs = [[] for _ in range(coord.world_size)]
        needs[me] = list(mine)
    batches = assign_reads(md, needs)
    reading = [b for b in batches if b.reader == me]
    outgoing: list[tuple[ReadBatch, torch.Tensor]] = []

    def read_mine() -> int:
        _check_files(md, storage, [mine.get(k) or ShardRead(k[0], k[1], ()) for b in reading for k in b.keys], me)
        total = 0
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="unickpt-read") as pool:
            for b in reading:
                buf = torch.empty(b.nbytes, dtype=torch.uint8) if len(b.consumers) > 1 else None
                total += _read_batch(md, storage, pool, items, mine, b, buf, verify, me)
                if buf is not None:
                    outgoing.append((b, buf))
        return total

    total = run_stage(coord, "load (read)", read_mine)
    if coord.world_size == 1 or not any(len(b.consumers) > 1 for b in batches):
        return total
    recvs = []
    for b in batches:
        if b.reader != me and me in b.consumers:
            buf = torch.empty(b.nbytes, dtype=torch.uint8)
            recvs.append((b, buf, coord.irecv(buf, b.reader, b.batch_id)))
    sends = [coord.isend(buf, dst, b.batch_id) for b, buf in outgoing for dst in b.consumers if dst != me]
    for b, buf, work in recvs:
        work.wait()
        for key, off in zip(b.keys, b.offsets):
            _apply(md, items, mine[key], buf[off: off + md.tensors[key[0]].shards[key[1]].byte_length])
    for w in sends:
        w.wait()
    return total


def _read_batch(md: Metadata, storage: Storage, pool: ThreadPoolExecutor, items: list[LoadItem],
                mine: dict[tuple[str, int], ShardRead], b: ReadBatch, buf: torch.Tensor | None,
                verify: bool, rank: int) -> int:
    """Read one batch's shards (into ``buf`` if it is to be forwarded, else straight into the
    destination where possible), verify them and copy this rank's pieces into place."""
    tasks, checks = [], []
    total = 0
    for key, off in zip(b.keys, b.offsets):
        shard = md.tensors[key[0]].shards[key[1]]
        target = _direct_target(md, items, mine.get(key)) if buf is None else None
        if target is None:
            region = (buf[off: off + shard.byte_length] if buf is not None
                      else torch.empty(shard.byte_length, dtype=torch.uint8))
            view = memoryview(region.numpy()).cast("B") if shard.byte_length else memoryview(b"")  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
        else:
            region, view = None, target
        name = md.files[shard.file_index]
        for start in range(0, len(view), _CHUNK):
            tasks.append(pool.submit(storage.read_into, name, shard.byte_offset + start,
                                     view[start: start + _CHUNK]))
        checks.append((key, view, region))
        total += shard.byte_length
    for t in tasks:
        t.result()
    if verify:
        for f in [pool.submit(_verify, md, storage, key, view, rank) for key, view, _ in checks]:
            f.result()
    for key, _view, region in checks:
        if region is not None and key in mine:
            _apply(md, items, mine[key], region)
    return total


def _direct_target(md: Metadata, items: list[LoadItem], r: ShardRead | None) -> memoryview | None:
    """The destination memory itself, when the shard lands whole in one contiguous CPU region."""
    if r is None or len(r.copies) != 1:
        return None
    c = r.copies[0]
    shard = md.tensors[r.fqn].shards[r.shard_index]
    dest = items[c.item_index].tensor
    if c.lengths != shard.lengths or dest.device.type != "cpu" or not dest.is_contiguous():
        return None
    if not sub_box_is_contiguous(tuple(dest.shape), c.dst_offsets, c.lengths):
        return None
    return tensor_bytes(sub_box(dest, c.dst_offsets, c.lengths)) if shard.byte_length else None


def _verify(md: Metadata, storage: Storage, key: tuple[str, int], view: memoryview, rank: int) -> None:
    shard = md.tensors[key[0]].shards[key[1]]
    got = crc32c.crc32c(view)
    if got != shard.crc32c:
        raise ChecksumMismatchError(
            f"rank {rank}: checksum mismatch for {key[0]!r} shard offsets={shard.offsets} "
            f"lengths={shard.lengths} in {storage.url}/{md.files[shard.file_index]} at byte "
            f"{shard.byte_offset}: stored {shard.crc32c:#010x}, read {got:#010x} (the file is corrupt)")


def _apply(md: Metadata, items: list[LoadItem], r: ShardRead, region: torch.Tensor) -> None:
    rec = md.tensors[r.fqn]
    shard = rec.shards[r.shard_index]
    src = box_view(region, dtype_from_name(rec.dtype), shard.lengths)
    with torch.no_grad():
        for c in r.copies:
            dest = sub_box(items[c.item_index].tensor, c.dst_offsets, c.lengths)
            dest.copy_(sub_box(src, c.src_offsets, c.lengths))


def read_blob(md: Metadata, storage: Storage, blob: BlobRecord, rank: int) -> bytes:
    name = md.files[blob.file_index]
    size = storage.size(name)
    if size is None:
        raise MissingDataFileError(f"rank {rank}: data file {storage.url}/{name} (holding {blob.key!r}) is missing")
    if size < blob.byte_offset + blob.byte_length:
        raise TruncatedDataFileError(f"rank {rank}: data file {storage.url}/{name} is truncated ({blob.key!r})")
    out = bytearray(blob.byte_length)
    storage.read_into(name, blob.byte_offset, memoryview(out))
    if crc32c.crc32c(out) != blob.crc32c:
        raise ChecksumMismatchError(f"rank {rank}: checksum mismatch for {blob.key!r} in {storage.url}/{name}")
    return bytes(out)


