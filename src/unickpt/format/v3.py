"""Format version 3: checksums of file chunks instead of shards; exact file sizes.

A version-3 document has the keys of version 2 (``format.v1``, ``format.v2``) with three changes:
shard rows and blobs carry no checksum (and shard rows no byte length: it is the box's size), and
one more key, ``"checksums"``, describes how every byte of every data file is verified::

    {"magic": "unickpt", "format_version": 3, "save_id", "created_unix", "role", "topology",
     "files": [names],
     "checksums": {"algorithm": "crc32c", "chunk_size": bytes,
                   "file_sizes": [exact size of each file],
                   "crcs": base64 of little-endian uint32: file 0's chunk checksums, then file 1's...},
     "tensors": {fqn: {"dtype", "shape",
                       "shards": [[*offsets, *lengths, file_index, byte_offset], ...]
                       | "shard_table": base64 of the same rows as little-endian int64}},
     "objects": {...},
     "blobs": {key: [file_index, byte_offset, byte_length]},
     "sections": {...}}                                   (as version 2)

Why: a reader that needs part of a saved shard (a resharding load to another world size) reads
and verifies only the chunks covering that part, not the whole shard; the checksums take 4 bytes
per chunk (1 MiB by default) whatever the number of tensors and ranks; and a cached layout's
metadata differs from the previous save's only in ids, sizes and checksums. The file sizes let
readers refuse a truncated or extended file before reading it, and bound every range the rows
name (``format.validation.checksum_problems``).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from ..errors import CorruptMetadataError
from .checksums import MAX_CHUNK, MIN_CHUNK, ChunkChecksums
from .dtypes import itemsize
from .records import BlobRecord, Metadata, ShardRecord, TensorRecord
from .sections import SectionRegistry
from .v1 import (
    MAGIC,
    TABLE_FROM,
    Ranges,
    _Bad,
    _created,
    _field,
    _files,
    _int,
    _part,
    _role,
    _table,
    _topology,
    _typed,
)
from .validation import (
    MAX_BYTES,
    MAX_NDIM,
    Problems,
    blob_problems,
    byte_range_problems,
    corrupt,
    extent_problems,
    file_name_problems,
    tensor_problems,
)

__all__ = ["VERSION", "V3Reader", "V3Writer", "READER", "WRITER"]

VERSION = 3
ALGORITHM = "crc32c"


class V3Writer:
    """Writes metadata whose checksums cover file chunks (``ChunkChecksums``)."""

    def can_write(self, md: Metadata, sections: SectionRegistry) -> bool:
        return isinstance(md.checksums, ChunkChecksums) and sections.min_format_version(md.sections) <= VERSION

    def write(self, md: Metadata, sections: SectionRegistry) -> dict[str, Any]:
        sums = md.checksums
        assert isinstance(sums, ChunkChecksums)
        tensors = {}
        for fqn, t in md.tensors.items():
            rows = [[*s.offsets, *s.lengths, s.file_index, s.byte_offset] for s in t.shards]
            entry: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape)}
            if len(rows) >= TABLE_FROM:
                entry["shard_table"] = base64.b64encode(np.asarray(rows, dtype="<i8").tobytes()).decode("ascii")
            else:
                entry["shards"] = rows
            tensors[fqn] = entry
        return {
            "magic": MAGIC,
            "format_version": VERSION,
            "save_id": md.save_id,
            "created_unix": md.created_unix,
            "role": md.role,
            "topology": {
                "framework": md.topology.framework,
                "world_size": md.topology.world_size,
                "mesh": [[name, size] for name, size in md.topology.mesh],
            },
            "files": list(md.files),
            "checksums": {
                "algorithm": ALGORITHM,
                "chunk_size": sums.chunk_size,
                "file_sizes": list(sums.file_sizes),
                "crcs": base64.b64encode(sums.crcs).decode("ascii"),
            },
            "tensors": tensors,
            "objects": md.objects,
            "blobs": {k: [b.file_index, b.byte_offset, b.byte_length] for k, b in md.blobs.items()},
            "sections": sections.encode(md.sections),
        }


class V3Reader:
    """Reads a version-3 document: sections first (a required section this unickpt does not
    know refuses the checkpoint before anything else is judged), then every other part; one
    ``CorruptMetadataError`` lists every problem."""

    def read(self, doc: dict[str, Any], source: str, sections: SectionRegistry) -> Metadata:
        problems = Problems()
        records: dict[str, object] = {}
        if "sections" not in doc:
            problems.add("missing field 'sections' (every version-3 document has one)")
        else:
            records = sections.decode(doc["sections"], VERSION, source, problems)
        md = _read_body(doc, problems)
        problems.raise_if_any(lambda text: corrupt(source, text))
        assert md is not None
        return replace(md, sections=records)


def _read_body(doc: dict[str, Any], problems: Problems) -> Metadata | None:
    files = _part(problems, "files", lambda: _files(doc))
    nfiles = len(files) if files is not None else None
    if files is not None:
        problems.extend(file_name_problems(files))
    topology = _part(problems, "topology", lambda: _topology(doc))
    sums = _part(problems, "checksums", lambda: _checksums(doc, nfiles))
    ranges: Ranges = []
    tensors = _tensors(doc, nfiles, problems, ranges)
    blobs = _blobs(doc, nfiles, problems, ranges)
    if files is not None:
        problems.extend(byte_range_problems(files, ranges))
        if sums is not None and not problems:
            problems.extend(extent_problems(files, sums.file_sizes, ranges))
    objects = _part(problems, "objects", lambda: _typed(doc.get("objects", {}), dict, "objects must be an object"))
    created = _part(problems, "created_unix", lambda: _created(_field(doc, "created_unix")))
    role = _part(problems, "role", lambda: _role(doc.get("role")))
    save_id = _part(problems, "save_id", lambda: _typed(_field(doc, "save_id"), str, "save_id must be a string"))
    if problems:
        return None
    assert files is not None and topology is not None and objects is not None and sums is not None
    assert created is not None and save_id is not None
    return Metadata(
        format_version=VERSION,
        save_id=save_id,
        created_unix=created,
        topology=topology,
        files=tuple(files),
        tensors=tensors,
        objects=objects,
        blobs=blobs,
        role=role,
        checksums=sums,
    )


def _checksums(doc: dict[str, Any], nfiles: int | None) -> ChunkChecksums:
    raw = _typed(_field(doc, "checksums"), dict, "checksums must be an object")
    algorithm = _field(raw, "algorithm", "checksums: ")
    if algorithm != ALGORITHM:
        raise _Bad(f"checksums: unknown algorithm {algorithm!r} (this unickpt verifies {ALGORITHM!r})")
    chunk = _int(_field(raw, "chunk_size", "checksums: "), "checksums.chunk_size", MIN_CHUNK, MAX_CHUNK)
    sizes = _field(raw, "file_sizes", "checksums: ")
    if not isinstance(sizes, list):
        raise _Bad("checksums.file_sizes must be a list")
    if nfiles is not None and len(sizes) != nfiles:
        raise _Bad(f"checksums.file_sizes has {len(sizes)} sizes for {nfiles} files")
    file_sizes = tuple(_int(s, "checksums.file_sizes entry") for s in sizes)
    want = sum(-(-s // chunk) for s in file_sizes)
    text = _typed(_field(raw, "crcs", "checksums: "), str, "checksums.crcs must be a base64 string")
    chars = 4 * -(-4 * want // 3)  # base64 of 4 bytes per chunk: checked before decoding anything
    if len(text) != chars:
        raise _Bad(f"checksums.crcs has {len(text)} base64 characters; {want} chunk checksums need {chars}")
    try:
        crcs = base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        raise _Bad("checksums.crcs is not valid base64") from None
    sums = ChunkChecksums(chunk, file_sizes, crcs)
    found = sums.problems()
    if found:
        raise _Bad("checksums: " + "; ".join(found))
    return sums


def _tensors(doc: dict[str, Any], nfiles: int | None, problems: Problems, ranges: Ranges) -> dict[str, TensorRecord]:
    raw = _part(problems, "tensors", lambda: _typed(_field(doc, "tensors"), dict, "tensors must be an object"))
    tensors: dict[str, TensorRecord] = {}
    for fqn, entry in (raw or {}).items():
        parsed = _part(problems, f"tensor {fqn!r}", partial(_tensor, fqn, entry))
        if parsed is None:
            continue
        dtype, shape, table = parsed
        found = tensor_problems(fqn, shape, dtype, table, nfiles)
        if found:
            problems.extend(found)
            continue
        nd = len(shape)
        ranges.append((fqn, table[:, 2 * nd], table[:, 2 * nd + 1], table[:, 2 * nd + 2]))
        if not problems:  # records only for a document that may still decode
            f = 2 * nd
            shards = tuple(ShardRecord(tuple(r[:nd]), tuple(r[nd:f]), r[f], r[f + 1], r[f + 2]) for r in table.tolist())
            tensors[fqn] = TensorRecord(fqn, dtype, shape, shards)
    return tensors


def _tensor(fqn: str, t: Any) -> tuple[str, tuple[int, ...], np.ndarray]:
    """dtype, shape and the shard rows of one tensor entry with their byte lengths appended (the
    table ``format.validation.tensor_problems`` checks)."""
    head = f"tensor {fqn!r}: "
    dtype = _field(t, "dtype", head)
    if not isinstance(dtype, str):
        raise _Bad(f"{head}dtype must be a string")
    raw_shape = _field(t, "shape", head)
    if not isinstance(raw_shape, list) or len(raw_shape) > MAX_NDIM:
        raise _Bad(f"{head}shape must be a list of at most {MAX_NDIM} sizes")
    shape = tuple(_int(d, f"tensor {fqn!r} shape") for d in raw_shape)
    nd = len(shape)
    width = 2 * nd + 2
    try:
        isz = itemsize(dtype)
    except CorruptMetadataError:
        raise _Bad(f"{head}unknown dtype {dtype!r}") from None
    if "shard_table" not in t:  # a few rows: checked and sized in plain Python
        listed = _field(t, "shards", head)
        if not isinstance(listed, list):
            raise _Bad(f"{head}shards must be a list")
        full = []
        for row in listed:
            if not isinstance(row, list) or len(row) != width:
                raise _Bad(f"{head}shard entry has the wrong length")
            for v in row:
                _int(v, f"tensor {fqn!r} shard field")
            nbytes = isz
            for n in row[nd : 2 * nd]:
                nbytes *= n
            full.append([*row, min(nbytes, MAX_BYTES + 1)])
        return dtype, shape, np.array(full, dtype=np.int64).reshape(len(full), width + 1)
    rows = _table(head, t["shard_table"], width)
    lens = np.clip(rows[:, nd : 2 * nd], 0, MAX_BYTES)  # absurd rows are refused by tensor_problems
    with np.errstate(over="ignore"):
        sizes = np.prod(lens, axis=1, dtype=np.int64) * isz
    sizes = np.where((sizes < 0) | (sizes > MAX_BYTES), MAX_BYTES + 1, sizes)
    return dtype, shape, np.concatenate([rows, sizes.reshape(-1, 1)], axis=1)


def _blobs(doc: dict[str, Any], nfiles: int | None, problems: Problems, ranges: Ranges) -> dict[str, BlobRecord]:
    raw = _part(problems, "blobs", lambda: _typed(doc.get("blobs", {}), dict, "blobs must be an object"))
    blobs: dict[str, BlobRecord] = {}
    for key, row in (raw or {}).items():
        blob = _part(problems, f"blob {key!r}", partial(_blob, key, row))
        if blob is None:
            continue
        found = blob_problems(blob, nfiles)
        if found:
            problems.extend(found)
            continue
        one = np.array([blob.file_index, blob.byte_offset, blob.byte_length], dtype=np.int64)
        ranges.append((key, one[0:1], one[1:2], one[2:3]))
        blobs[key] = blob
    return blobs


def _blob(key: str, row: Any) -> BlobRecord:
    if not isinstance(row, list) or len(row) != 3:
        raise _Bad(f"blob {key!r}: entry must be [file, offset, length]")
    fidx, boff, blen = (_int(v, f"blob {key!r} field") for v in row)
    return BlobRecord(key, fidx, boff, blen)


READER = V3Reader()
WRITER = V3Writer()
