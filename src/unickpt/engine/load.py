"""The load engine: metadata -> validation -> ranged parallel reads -> copies in place.

Call order (every rank; * = collective on the checkpoint group):
  ``read_metadata``*  rank 0 reads and validates the metadata, broadcasts the bytes; a missing
                      metadata file is told apart as an interrupted save or not a checkpoint;
  ``check_targets``   every problem with keys, shapes and dtypes, before any data I/O;
  ``plan_local_load`` which saved shards this rank needs and which sub-boxes go where;
  ``read_stage``      file sizes checked, then whole shards read by a thread pool (straight into
                      the destination when the boxes coincide), CRC32C verified, sub-boxes copied;
  agreement*          every rank learns whether all ranks succeeded.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch

from ..coordination.base import Coordinator
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
from ..planning.load_plan import ShardRead
from ..planning.specs import LoadItem
from ..storage.base import Storage
from .bytes_view import box_view, sub_box, tensor_bytes

__all__ = ["read_metadata", "read_stage", "read_blob"]


def _read_metadata_local(storage: Storage) -> bytes:
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
        return decode_metadata(_read_metadata_local(storage), f"{storage.url}/{METADATA_FILE}")
    payload: object = None
    if coord.rank == 0:
        try:
            payload = _read_metadata_local(storage)
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


def read_stage(md: Metadata, storage: Storage, items: list[LoadItem], reads: list[ShardRead],
               rank: int, threads: int, verify: bool) -> int:
    """Read and place every needed shard; return the number of bytes read."""
    _check_files(md, storage, reads, rank)

    def one(r: ShardRead) -> int:
        rec = md.tensors[r.fqn]
        shard = rec.shards[r.shard_index]
        dtype = dtype_from_name(rec.dtype)
        name = md.files[shard.file_index]
        direct = None
        if len(r.copies) == 1:
            c = r.copies[0]
            dest = items[c.item_index].tensor
            if (c.lengths == shard.lengths and tuple(dest.shape) == c.lengths
                    and dest.device.type == "cpu" and dest.is_contiguous()):
                direct = dest
        if direct is not None:
            view = tensor_bytes(direct)
            storage.read_into(name, shard.byte_offset, view)
            buf = None
        else:
            buf = torch.empty(shard.byte_length, dtype=torch.uint8)
            view = memoryview(buf.numpy()).cast("B") if shard.byte_length else memoryview(b"")
            storage.read_into(name, shard.byte_offset, view)
        if verify:
            got = crc32c.crc32c(view)
            if got != shard.crc32c:
                raise ChecksumMismatchError(
                    f"rank {rank}: checksum mismatch for {r.fqn!r} shard offsets={shard.offsets} "
                    f"lengths={shard.lengths} in {storage.url}/{name} at byte {shard.byte_offset}: "
                    f"stored {shard.crc32c:#010x}, read {got:#010x} (the file is corrupt)")
        if buf is not None:
            src = box_view(buf, dtype, shard.lengths)
            with torch.no_grad():
                for c in r.copies:
                    dest = sub_box(items[c.item_index].tensor, c.dst_offsets, c.lengths)
                    dest.copy_(sub_box(src, c.src_offsets, c.lengths))
        return shard.byte_length

    if threads <= 1 or len(reads) <= 1:
        return sum(one(r) for r in reads)
    with ThreadPoolExecutor(min(threads, len(reads)), thread_name_prefix="unickpt-read") as pool:
        return sum(f.result() for f in [pool.submit(one, r) for r in reads])


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


