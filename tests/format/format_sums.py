"""Checksums for metadata that tests build in memory (records without data files).

``chunk_sums(files, tensors, blobs)``: a ``ChunkChecksums`` whose file sizes are where each
file's last shard or blob ends and whose checksums are zeros (``crc``), so that such metadata
encodes as the newest format; tests that read data compute real checksums instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from unickpt.format import BlobRecord, TensorRecord
from unickpt.format.checksums import ChunkChecksums


def chunk_sums(
    files: Sequence[str],
    tensors: Mapping[str, TensorRecord] | Iterable[TensorRecord] = (),
    blobs: Mapping[str, BlobRecord] | Iterable[BlobRecord] = (),
    chunk: int = 4096,
    crc: int = 0,
) -> ChunkChecksums:
    recs = tensors.values() if isinstance(tensors, Mapping) else tensors
    bs = blobs.values() if isinstance(blobs, Mapping) else blobs
    sizes = [0] * len(files)
    for rec in recs:
        for s in rec.shards:
            sizes[s.file_index] = max(sizes[s.file_index], s.byte_offset + s.byte_length)
    for b in bs:
        sizes[b.file_index] = max(sizes[b.file_index], b.byte_offset + b.byte_length)
    return ChunkChecksums.from_files(chunk, [(n, [crc] * -(-n // chunk)) for n in sizes])
