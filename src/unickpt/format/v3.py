"""Format version 3: checksums of file chunks instead of shards; exact file sizes.

A version-3 document has the keys of version 2 (``format.v1``, ``format.v2``) with three changes:
shard rows and blobs carry no checksum (and shard rows no byte length: it is the box's size), and
one more key, ``"checksums"``, describes how every byte of every data file is verified::

    {"magic": "unickpt", "format_version": 3, "save_id", "created_unix", "role", "topology",
     "files": [names],
     "checksums": {"algorithm": "crc32c", "chunk_size": bytes,
                   "file_sizes": [exact size of each file],
                   "crcs": base64 of little-endian uint32: file 0's chunk checksums, then file 1's...},
     "layouts": [{"files": [file index of each part, ...] | "files_table": base64 of little-endian int32,
                  "entries": [[fqn, dim], ...]}, ...],           (optional: format.layouts)
     "tensors": {fqn: {"dtype", "shape",
                       "shards": [[*offsets, *lengths, file_index, byte_offset], ...]
                       | "shard_table": base64 of the same rows as little-endian int64
                       | "layout": index of the layout that holds it}},
     "objects": {...},
     "blobs": {key: [file_index, byte_offset, byte_length]},
     "sections": {...}}                                   (as version 2)

Why: a reader that needs part of a saved shard (a resharding load to another world size) reads
and verifies only the chunks covering that part, not the whole shard; the checksums take 4 bytes
per chunk (1 MiB by default) whatever the number of tensors and ranks; and a cached layout's
metadata differs from the previous save's only in ids, sizes and checksums. The file sizes let
readers refuse a truncated or extended file before reading it, and bound every range the rows
name (``format.validation.checksum_problems``). Layouts (``format.layouts.SplitLayout``)
describe tensors split the same way over many files once, instead of a row per file; their
chunks take part in the same checks (every byte range inside its file, none overlapping another).
"""

from __future__ import annotations

import base64
import binascii
import math
from functools import partial
from typing import Any

import numpy as np

from ..errors import CorruptMetadataError
from .checksums import MAX_CHUNK, MIN_CHUNK, ChunkChecksums
from .dtypes import DTYPE_NAMES, itemsize
from .layouts import SplitLayout, SplitShards
from .records import BlobRecord, Metadata, ShardRecord, TensorRecord
from .sections import SectionRegistry
from .v1 import (
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
    tensor_entry,
    write_head,
)
from .v2 import read_sectioned
from .validation import (
    MAX_BYTES,
    MAX_NDIM,
    OwnedRanges,
    Problems,
    blob_problems,
    byte_range_problems,
    extent_problems,
    file_name_problems,
    splits_one_dim,
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
        layouts: dict[int, tuple[int, SplitLayout]] = {}  # id(layout) -> (index, layout)
        for fqn, t in md.tensors.items():
            if isinstance(t.shards, SplitShards):
                lay = t.shards.layout
                index = layouts.setdefault(id(lay), (len(layouts), lay))[0]
                tensors[fqn] = {"dtype": t.dtype, "shape": list(t.shape), "layout": index}
                continue
            rows = [[*s.offsets, *s.lengths, s.file_index, s.byte_offset] for s in t.shards]
            tensors[fqn] = tensor_entry(t.dtype, t.shape, rows)
        return {
            **write_head(md, VERSION),
            "checksums": {
                "algorithm": ALGORITHM,
                "chunk_size": sums.chunk_size,
                "file_sizes": list(sums.file_sizes),
                "crcs": base64.b64encode(sums.crcs).decode("ascii"),
            },
            **({"layouts": [_write_layout(lay) for _, lay in layouts.values()]} if layouts else {}),
            "tensors": tensors,
            "objects": md.objects,
            "blobs": {k: [b.file_index, b.byte_offset, b.byte_length] for k, b in md.blobs.items()},
            "sections": sections.encode(md.sections),
        }


def _write_layout(lay: SplitLayout) -> dict[str, Any]:
    entries = [[fqn, d] for fqn, _, _, d in lay.entries]
    if len(lay.files) >= TABLE_FROM:
        table = base64.b64encode(np.asarray(lay.files, dtype="<i4").tobytes()).decode("ascii")
        return {"files_table": table, "entries": entries}
    return {"files": list(lay.files), "entries": entries}


class V3Reader:
    """Reads a version-3 document: sections first (a required section this unickpt does not
    know refuses the checkpoint before anything else is judged), then every other part; one
    ``CorruptMetadataError`` lists every problem."""

    def read(self, doc: dict[str, Any], source: str, sections: SectionRegistry) -> Metadata:
        return read_sectioned(doc, source, sections, VERSION, lambda problems: _read_body(doc, problems))


def _read_body(doc: dict[str, Any], problems: Problems) -> Metadata | None:
    files = _part(problems, "files", lambda: _files(doc))
    nfiles = len(files) if files is not None else None
    if files is not None:
        problems.extend(file_name_problems(files))
    topology = _part(problems, "topology", lambda: _topology(doc))
    sums = _part(problems, "checksums", lambda: _checksums(doc, nfiles))
    ranges: Ranges = []
    layouts = _layouts(doc, nfiles, problems)
    tensors = _tensors(doc, nfiles, problems, ranges, layouts)
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


def _tensors(
    doc: dict[str, Any], nfiles: int | None, problems: Problems, ranges: Ranges, layouts: list[_RawLayout]
) -> dict[str, TensorRecord]:
    raw = _part(problems, "tensors", lambda: _typed(_field(doc, "tensors"), dict, "tensors must be an object"))
    tensors: dict[str, TensorRecord] = {}
    split: dict[str, tuple[str, tuple[int, ...], int]] = {}  # tensors of a layout: dtype, shape, layout
    small = _SmallRows()
    nlayouts = len(layouts)
    for fqn, entry in (raw or {}).items():
        if isinstance(entry, dict) and "layout" in entry:
            got = _plain_layout_tensor(entry, nlayouts)  # the common well-formed entry, checked inline
            if got is None:  # anything else: parsed again, saying what is wrong
                got = _part(problems, f"tensor {fqn!r}", partial(_layout_tensor, fqn, entry, nlayouts))
            if got is not None:
                split[fqn] = got
            continue
        rec = small.take(fqn, entry, nfiles)  # the common small case, checked in plain Python
        if rec is not None:
            tensors[fqn] = rec
            continue
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
    ranges.append(small.ranges())
    by_layout = _split_tensors(layouts, split, problems, ranges)
    if problems:
        return {}
    tensors.update(by_layout)
    return tensors


class _SmallRows:
    """Tensors with few shard rows, all well-formed and tiling the tensor along at most one
    dimension (nearly every tensor), decoded in plain Python without a table each; their byte
    ranges are collected for the file-wide checks in one ``OwnedRanges``. ``take`` returns None
    for anything else, which the full path then parses and reports."""

    def __init__(self) -> None:
        self.owners: list[str] = []
        self.rows: list[tuple[int, int, int, int]] = []  # (owner, file, offset, length)

    def take(self, fqn: str, t: Any, nfiles: int | None) -> TensorRecord | None:
        if type(t) is not dict or "shard_table" in t or nfiles is None:
            return None
        dtype, shape, listed = t.get("dtype"), t.get("shape"), t.get("shards")
        if type(dtype) is not str or type(shape) is not list or type(listed) is not list or len(listed) > 16:
            return None
        isz = _ITEMSIZE.get(dtype)
        nd = len(shape)
        if isz is None or nd > MAX_NDIM or not all(type(d) is int and 0 <= d <= MAX_BYTES for d in shape):
            return None
        if math.prod(shape) * isz > MAX_BYTES:
            return None
        if nd == 0 and len(listed) == 1:  # a scalar (Adam's step): one row [file, offset]
            return self._scalar(fqn, dtype, isz, listed[0], nfiles)
        width = 2 * nd + 2
        offs, lens, shards = [], [], []
        for row in listed:
            if (
                type(row) is not list
                or len(row) != width
                or not all(type(v) is int and 0 <= v <= MAX_BYTES for v in row)
            ):
                return None
            o, n = row[:nd], row[nd : 2 * nd]
            if any(a + b > s for a, b, s in zip(o, n, shape)) or row[2 * nd] >= nfiles:
                return None
            nbytes = math.prod(n) * isz
            if row[-1] + nbytes > MAX_BYTES:
                return None
            offs.append(o)
            lens.append(n)
            shards.append(ShardRecord(tuple(o), tuple(n), row[2 * nd], row[2 * nd + 1], nbytes))
        if not math.prod(shape) or not splits_one_dim(tuple(shape), offs, lens):
            return None  # empty tensors and other tilings take the full path
        who = len(self.owners)
        self.owners.append(fqn)
        self.rows.extend((who, s.file_index, s.byte_offset, s.byte_length) for s in shards)
        return TensorRecord(fqn, dtype, tuple(shape), tuple(shards))

    def _scalar(self, fqn: str, dtype: str, isz: int, row: Any, nfiles: int) -> TensorRecord | None:
        """``take`` of a 0-d tensor's one row: the same checks, spelled out for two fields."""
        if type(row) is not list or len(row) != 2:
            return None
        f, offset = row
        if type(f) is not int or type(offset) is not int or not 0 <= f < nfiles or not 0 <= offset <= MAX_BYTES - isz:
            return None
        self.rows.append((len(self.owners), f, offset, isz))
        self.owners.append(fqn)
        return TensorRecord(fqn, dtype, (), (ShardRecord((), (), f, offset, isz),))

    def ranges(self) -> OwnedRanges:
        a = np.array(self.rows, dtype=np.int64).reshape(-1, 4)
        return OwnedRanges(self.owners, a[:, 0], a[:, 1], a[:, 2], a[:, 3])


_ITEMSIZE = {name: itemsize(name) for name in DTYPE_NAMES}


_RawLayout = tuple[list[int], list[tuple[str, int]]]  # files, entries (fqn, dim)


def _layouts(doc: dict[str, Any], nfiles: int | None, problems: Problems) -> list[_RawLayout]:
    """The ``layouts`` list, type-checked: each one's files (distinct, known, in no other layout)
    and entries; the tensors they name are checked with the tensors (``_split_tensors``)."""
    raw = _part(problems, "layouts", lambda: _typed(doc.get("layouts", []), list, "layouts must be a list"))
    out: list[_RawLayout] = []
    owner: dict[int, int] = {}
    for li, entry in enumerate(raw or []):
        got = _part(problems, f"layout {li}", partial(_layout, li, entry, nfiles))
        if got is None:
            out.append(([], []))
            continue
        for f in got[0]:
            if f in owner:
                problems.add(f"layout {li}: file #{f} also belongs to layout {owner[f]}")
            owner[f] = li
        out.append(got)
    return out


def _layout(li: int, entry: Any, nfiles: int | None) -> _RawLayout:
    head = f"layout {li}: "
    if not isinstance(entry, dict):
        raise _Bad(f"{head}must be an object")
    if "files_table" in entry:
        text = _typed(entry["files_table"], str, f"{head}files_table must be a base64 string")
        if nfiles is not None and len(text) > 4 * -(-4 * nfiles // 3):
            raise _Bad(f"{head}files_table is longer than {nfiles} files")
        try:
            data = base64.b64decode(text, validate=True)
        except (ValueError, binascii.Error):
            raise _Bad(f"{head}files_table is not valid base64") from None
        if len(data) % 4:
            raise _Bad(f"{head}files_table is not whole 32-bit values")
        files = np.frombuffer(data, dtype="<i4").tolist()
    else:
        files = _field(entry, "files", head)
        if not isinstance(files, list):
            raise _Bad(f"{head}files must be a list")
    limit = (nfiles - 1) if nfiles is not None else MAX_BYTES
    files = [_int(f, f"{head}file index", 0, limit) for f in files]
    if not files or len(set(files)) != len(files):
        raise _Bad(f"{head}needs at least one file, each once")
    listed = _field(entry, "entries", head)
    if not isinstance(listed, list) or not listed:
        raise _Bad(f"{head}entries must be a non-empty list")
    entries = []
    for row in listed:
        if not isinstance(row, list) or len(row) != 2 or not isinstance(row[0], str):
            raise _Bad(f"{head}each entry is [tensor name, dimension]")
        d = row[1]
        if type(d) is not int or not 0 <= d < MAX_NDIM:
            d = _int(d, f"{head}dimension", 0, MAX_NDIM - 1)  # raises, saying why
        entries.append((row[0], d))
    return files, entries


def _plain_layout_tensor(t: dict[str, Any], nlayouts: int) -> tuple[str, tuple[int, ...], int] | None:
    """``_layout_tensor``'s answer for an entry it accepts with plain JSON types (every entry a
    writer makes), without building a problem text; None for anything else (then
    ``_layout_tensor`` parses it and says what is wrong)."""
    dtype, shape, li = t.get("dtype"), t.get("shape"), t.get("layout")
    if type(dtype) is not str or type(shape) is not list or type(li) is not int or not 0 <= li < nlayouts:
        return None
    if not 1 <= len(shape) <= MAX_NDIM:
        return None
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_BYTES:
            return None
    return dtype, tuple(shape), li


def _layout_tensor(fqn: str, t: Any, nlayouts: int) -> tuple[str, tuple[int, ...], int]:
    """dtype, shape and layout index of a tensor held by a layout."""
    head = f"tensor {fqn!r}: "
    dtype = _field(t, "dtype", head)
    if not isinstance(dtype, str):
        raise _Bad(f"{head}dtype must be a string")
    raw_shape = _field(t, "shape", head)
    if not isinstance(raw_shape, list) or not 1 <= len(raw_shape) <= MAX_NDIM:
        raise _Bad(f"{head}a layout's tensor has 1 to {MAX_NDIM} dimensions")
    shape = tuple(_int(d, f"tensor {fqn!r} shape") for d in raw_shape)
    if nlayouts == 0:
        raise _Bad(f"{head}names a layout, but the metadata has none")
    return dtype, shape, _int(t["layout"], f"tensor {fqn!r} layout", 0, nlayouts - 1)


def _split_tensors(
    layouts: list[_RawLayout],
    split: dict[str, tuple[str, tuple[int, ...], int]],
    problems: Problems,
    ranges: Ranges,
) -> dict[str, TensorRecord]:
    """The records of every layout's tensors: each tensor in exactly the layout it names, once,
    split along one of its dimensions, sized within bounds; each layout's bytes in each of its
    files become one range of the byte-range checks."""
    out: dict[str, TensorRecord] = {}
    placed: dict[str, int] = {}
    for li, (files, entries) in enumerate(layouts):
        rows = []
        for fqn, d in entries:
            found = split.get(fqn)
            if found is None or found[2] != li or fqn in placed:
                problems.add(f"layout {li}: tensor {fqn!r} is not a tensor of this layout (or is listed twice)")
                continue
            placed[fqn] = li
            dtype, shape, _ = found
            if d >= len(shape):
                problems.add(f"layout {li}: tensor {fqn!r}: dimension {d} of a rank-{len(shape)} tensor")
                continue
            isz = _ITEMSIZE.get(dtype)
            if isz is None:
                problems.add(f"tensor {fqn!r}: unknown dtype {dtype!r}")
                continue
            if math.prod(shape) * isz > MAX_BYTES:
                problems.add(f"tensor {fqn!r}: shape {shape} is absurdly large")
                continue
            rows.append((fqn, isz, shape, d))
        if problems or not files:
            continue
        lay = SplitLayout(tuple(files), tuple(rows))
        ends = lay.ends()
        ranges.append((f"layout {li}", np.asarray(files, dtype=np.int64), np.zeros(len(files), dtype=np.int64), ends))
        for e, (fqn, _, shape, _) in enumerate(rows):
            out[fqn] = TensorRecord(fqn, split[fqn][0], shape, SplitShards(lay, e))
    for fqn, (_, _, li) in split.items():
        if fqn not in placed:
            problems.add(f"tensor {fqn!r} names layout {li}, which does not list it")
    return out


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
