"""One-process reads of a checkpoint's metadata and blobs (the load's first and last reads).

``read_metadata``* (collective on the checkpoint group): rank 0 reads and validates the metadata,
broadcasts the bytes; a missing metadata file is told apart as an interrupted save or not a
checkpoint (``folder.probe.read_metadata_bytes``, also used by ``ops``). ``read_blob``: one extra_state /
dataloader blob, bounded and checksum-verified. The tensors' reads are ``engine.load.stage``'s.
"""

from __future__ import annotations

from ..coordination.base import Coordinator
from ..errors import (
    CheckpointError,
    ChecksumMismatchError,
    SizeLimitError,
    TruncatedDataFileError,
)
from ..folder.files import data_files, raise_problem
from ..folder.probe import read_metadata_bytes
from ..format.checksums import crc32c
from ..format.codec import decode_metadata
from ..format.records import METADATA_FILE, BlobRecord, Metadata
from ..planning.load.runs import cover_of
from ..storage.base import METADATA_LIMIT, Storage

__all__ = ["read_metadata", "read_blob", "BLOB_LIMIT"]

BLOB_LIMIT = 1 << 30  # default cap of one extra_state / dataloader blob (LoadOptions.limits.max_blob_bytes)


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


def read_blob(md: Metadata, storage: Storage, blob: BlobRecord, rank: int, cap: int = BLOB_LIMIT) -> bytes:
    """The bytes of ``blob``, checksum-verified; refused before allocating when over ``cap``.

    The allocation is bounded by the file's size and by ``cap`` (plus the checksum chunks at its
    ends), not by the blocks the file occupies (st_blocks): filesystems that compress or
    deduplicate (btrfs, ZFS) and network filesystems report fewer blocks than a legitimate file
    holds, so a block count would refuse good checkpoints. A sparse file within the cap costs at
    most ``cap`` bytes of memory and then fails its checksum."""
    name = md.files[blob.file_index]
    found = data_files(storage, md, indices=[blob.file_index])
    raise_problem(found, md, storage.url, f"rank {rank}: ", {blob.file_index: f"blob {blob.key!r}"})
    size = found[0].size
    assert size is not None  # complete
    if blob.byte_length > cap:
        raise SizeLimitError(
            f"rank {rank}: blob {blob.key!r} in {storage.url}/{name} claims {blob.byte_length} bytes, over the "
            f"cap of {cap} bytes per blob; refused before allocating it "
            "(LoadOptions(limits=LoadLimits(max_blob_bytes=...)) raises the cap for a checkpoint you trust)"
        )
    lo, hi = blob.byte_offset, blob.byte_offset + blob.byte_length
    units = cover_of(md, True)(blob.file_index, lo, hi)
    if units.hi > size:
        raise TruncatedDataFileError(f"rank {rank}: data file {storage.url}/{name} is truncated ({blob.key!r})")
    out = bytearray(units.hi - units.lo)
    storage.read_into(name, units.lo, memoryview(out))
    for start, end, want in zip(units.starts, units.ends, units.crcs):
        if crc32c(memoryview(out)[start - units.lo : end - units.lo]) != want:
            raise ChecksumMismatchError(
                f"rank {rank}: checksum mismatch for {blob.key!r} in {storage.url}/{name} bytes [{start}, {end})"
            )
    return bytes(out[lo - units.lo : hi - units.lo])
