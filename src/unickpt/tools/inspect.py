"""``unickpt inspect``: describe a checkpoint from its metadata alone, optionally verify its bytes.

Who calls what, in order (``cli.main`` -> ``run_inspect``):
  1. ``load_metadata(path)``  opens the storage (``open_storage``), reads the metadata bytes with
     ``engine.read.read_metadata_bytes`` (which tells an interrupted save from a folder that is no
     checkpoint) and decodes / validates them with ``format.decode_metadata``; no data file is read;
  2. ``file_sizes(storage, md)``  stats every data file (one cheap ``size`` call each, in parallel),
     so missing or short files show up without reading them;
  3. ``summarize(md, ...)``  pure function: Metadata -> ``Summary`` (tensors, topology, files, blobs,
     totals). Unit tests call it directly on a decoded Metadata;
  4. optional ``verify(md, storage)``  reads every shard and checks CRC32C through the load
     engine's own ``read_stage`` (same file checks, same error messages), batch by batch into one
     reusable buffer; a shard larger than the buffer, and every blob, is streamed through it with
     an incremental CRC32C, so memory stays fixed whatever sizes the metadata claims; it reports
     the first failures;
  5. ``format_text(summary)`` or ``to_json(summary)`` renders the result.
Errors are unickpt ``CheckpointError``s; the CLI prints them and exits with code 2.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c
import torch

from ..coordination.single import SingleProcessCoordinator
from ..engine.bytes_view import tensor_bytes
from ..engine.read import read_metadata_bytes, read_stage
from ..errors import CheckpointError, ChecksumMismatchError, TruncatedDataFileError
from ..format import METADATA_FILE, Metadata, decode_metadata, dtype_from_name
from ..planning.load_plan import CopyOp, ShardRead
from ..planning.specs import LoadItem, ShardSpec
from ..storage import Storage, open_storage
from ..storage.base import METADATA_LIMIT

__all__ = [
    "TensorInfo",
    "FileInfo",
    "BlobInfo",
    "Totals",
    "VerifyReport",
    "Summary",
    "load_metadata",
    "file_sizes",
    "summarize",
    "verify",
    "format_text",
    "to_dict",
    "to_json",
    "human_bytes",
    "short_files",
]

_ALIGN = 64  # scratch views start on 64-byte boundaries so any dtype view is aligned
_VERIFY_BATCH_BYTES = 64 << 20
_ONE = SingleProcessCoordinator()  # verify runs in this process only


@dataclass(frozen=True, slots=True)
class TensorInfo:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    shards: int
    bytes: int


@dataclass(frozen=True, slots=True)
class FileInfo:
    name: str
    bytes: int  # bytes the metadata assigns to this file (end of its last range)
    size_on_disk: int | None = None  # from storage (None: missing, or not checked)


@dataclass(frozen=True, slots=True)
class BlobInfo:
    key: str
    file: str
    bytes: int


@dataclass(frozen=True, slots=True)
class Totals:
    tensors: int
    shards: int
    tensor_bytes: int
    blobs: int
    blob_bytes: int
    files: int
    file_bytes: int  # sum of FileInfo.bytes
    metadata_bytes: int


@dataclass(slots=True)
class VerifyReport:
    ok: bool
    shards_checked: int
    blobs_checked: int
    bytes_checked: int
    seconds: float
    failures: list[str] = field(default_factory=list)  # the first failures, in file order
    failures_total: int = 0


@dataclass(slots=True)
class Summary:
    path: str
    format_version: int
    save_id: str
    created_unix: float
    role: str | None
    framework: str
    world_size: int
    mesh: tuple[tuple[str, int], ...]
    tensors: list[TensorInfo]
    files: list[FileInfo]
    blobs: list[BlobInfo]
    objects: list[str]
    totals: Totals
    sizes_checked: bool = False  # FileInfo.size_on_disk is filled in (None there = missing)
    verify: VerifyReport | None = None


def load_metadata(
    path: str, role: str | None = None, max_metadata_bytes: int = METADATA_LIMIT
) -> tuple[Storage, Metadata, int]:
    """Open ``path`` (``role``: a sub-checkpoint) and decode its metadata; no data reads.

    Returns (storage, metadata, metadata size in bytes). Raises NotACheckpointError,
    IncompleteCheckpointError, CorruptMetadataError, UnsupportedFormatVersionError, StorageError,
    SizeLimitError (metadata over ``max_metadata_bytes``)."""
    if role is not None:
        if not role or "/" in role or role.startswith("."):
            raise ValueError(f"invalid role {role!r}")
        path = f"{str(path).rstrip('/')}/{role}"
    storage = open_storage(str(path))
    raw = read_metadata_bytes(storage, max_metadata_bytes)
    return storage, decode_metadata(raw, f"{storage.url}/{METADATA_FILE}"), len(raw)


def file_sizes(storage: Storage, md: Metadata, threads: int = 16) -> dict[str, int | None]:
    """Size on storage of every data file named by ``md`` (None: missing); stats only."""
    if not md.files:
        return {}
    with ThreadPoolExecutor(max(1, min(threads, len(md.files))), thread_name_prefix="unickpt-stat") as pool:
        return dict(zip(md.files, pool.map(storage.size, md.files)))


def summarize(
    md: Metadata, path: str = "", sizes: dict[str, int | None] | None = None, metadata_bytes: int = 0
) -> Summary:
    """Pure: the human/JSON view of ``md``. ``sizes`` (from ``file_sizes``) adds on-disk sizes."""
    tensors = [
        TensorInfo(t.fqn, t.dtype, tuple(t.shape), len(t.shards), sum(s.byte_length for s in t.shards))
        for t in md.tensors.values()
    ]
    ends = [0] * len(md.files)
    for t in md.tensors.values():
        for s in t.shards:
            ends[s.file_index] = max(ends[s.file_index], s.byte_offset + s.byte_length)
    for b in md.blobs.values():
        ends[b.file_index] = max(ends[b.file_index], b.byte_offset + b.byte_length)
    files = [FileInfo(name, ends[i], None if sizes is None else sizes.get(name)) for i, name in enumerate(md.files)]
    blobs = [
        BlobInfo(b.key, md.files[b.file_index], b.byte_length) for b in sorted(md.blobs.values(), key=lambda b: b.key)
    ]
    totals = Totals(
        tensors=len(tensors),
        shards=sum(t.shards for t in tensors),
        tensor_bytes=sum(t.bytes for t in tensors),
        blobs=len(blobs),
        blob_bytes=sum(b.bytes for b in blobs),
        files=len(files),
        file_bytes=sum(f.bytes for f in files),
        metadata_bytes=metadata_bytes,
    )
    return Summary(
        path=path,
        format_version=md.format_version,
        save_id=md.save_id,
        created_unix=md.created_unix,
        role=md.role,
        framework=md.topology.framework,
        world_size=md.topology.world_size,
        mesh=tuple(md.topology.mesh),
        tensors=tensors,
        files=files,
        blobs=blobs,
        objects=sorted(md.objects),
        totals=totals,
        sizes_checked=sizes is not None,
    )


# ----------------------------------------------------------------------------------- verify


def _shard_reads(md: Metadata) -> list[tuple[str, int]]:
    """Every (fqn, shard index) in file / byte order, so reads sweep each file forward."""
    out = [(fqn, i) for fqn, t in md.tensors.items() for i in range(len(t.shards))]

    def order(key: tuple[str, int]) -> tuple[int, int]:
        s = md.tensors[key[0]].shards[key[1]]
        return (s.file_index, s.byte_offset)

    return sorted(out, key=order)


def _stream_crc(storage: Storage, name: str, offset: int, length: int, size: int | None, buf: memoryview) -> int:
    """CRC32C of bytes [offset, offset + length) of ``name``, read through ``buf`` piece by piece."""
    if size is not None and size < offset + length:
        raise TruncatedDataFileError(
            f"data file {storage.url}/{name} is truncated: {size} bytes, but bytes up to {offset + length} are needed"
        )
    crc, pos = 0, 0
    while pos < length:
        n = min(len(buf), length - pos)
        storage.read_into(name, offset + pos, buf[:n])
        crc = crc32c.crc32c(buf[:n], crc)
        pos += n
    return crc


def _scratch(pool: torch.Tensor, offset: int, dtype: torch.dtype, lengths: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(lengths) * dtype.itemsize
    return pool[offset : offset + n].view(dtype).view(lengths)


def verify(
    md: Metadata,
    storage: Storage,
    *,
    sizes: dict[str, int | None] | None = None,
    threads: int = 4,
    max_failures: int = 10,
    batch_bytes: int = _VERIFY_BATCH_BYTES,
) -> VerifyReport:
    """Read every shard and blob, check each CRC32C; never raises for a bad file, reports it.

    A missing data file is one failure (its shards are not tried). The other shards are read in
    batches of about ``batch_bytes`` into one reusable buffer by the load engine (``read_stage``
    with verification on); a failing batch is re-read shard by shard so every bad shard is
    reported (up to ``max_failures`` messages; all are counted). A shard larger than the buffer
    and every blob are streamed through it (incremental CRC32C): nothing else is allocated,
    whatever the metadata claims. ``sizes``: ``file_sizes``' result when the caller has it."""
    t0 = time.perf_counter()
    report = VerifyReport(ok=True, shards_checked=0, blobs_checked=0, bytes_checked=0, seconds=0.0)
    sizes = file_sizes(storage, md) if sizes is None else sizes
    missing = {i for i, name in enumerate(md.files) if sizes.get(name) is None}

    def fail(msg: str) -> None:
        report.ok = False
        report.failures_total += 1
        if len(report.failures) < max_failures:
            report.failures.append(msg)

    def stream(name: str, offset: int, length: int, crc: int, what: str) -> None:
        got = _stream_crc(storage, name, offset, length, sizes.get(name), tensor_bytes(pool))
        if got != crc:
            raise ChecksumMismatchError(
                f"checksum mismatch for {what} in {storage.url}/{name} at byte {offset}: stored "
                f"{crc:#010x}, read {got:#010x} (the file is corrupt)"
            )

    def run(batch: list[tuple[str, int]]) -> None:
        items: list[LoadItem] = []
        reads: list[ShardRead] = []
        offset = 0
        for fqn, sidx in batch:
            rec = md.tensors[fqn]
            shard = rec.shards[sidx]
            dtype = dtype_from_name(rec.dtype)
            if len(batch) == 1 and shard.byte_length > len(pool):
                what = f"{fqn!r} shard offsets={shard.offsets} lengths={shard.lengths}"
                stream(md.files[shard.file_index], shard.byte_offset, shard.byte_length, shard.crc32c, what)
                return
            dest = _scratch(pool, offset, dtype, shard.lengths)
            offset += -(-shard.byte_length // _ALIGN) * _ALIGN
            spec = ShardSpec(fqn, rec.dtype, rec.shape, shard.offsets, shard.lengths)
            zeros = (0,) * len(shard.lengths)
            reads.append(ShardRead(fqn, sidx, (CopyOp(len(items), zeros, zeros, shard.lengths),)))
            items.append(LoadItem(spec, dest))
        read_stage(md, storage, coord=_ONE, items=items, reads=reads, threads=threads, verify=True, dedup=False)

    def check(batch: list[tuple[str, int]]) -> None:
        try:
            run(batch)
        except CheckpointError as e:
            if len(batch) == 1:
                fail(f"{type(e).__name__}: {e}")
                return
            for one in batch:  # find every bad shard of the batch
                check([one])
            return
        report.shards_checked += len(batch)
        report.bytes_checked += sum(md.tensors[f].shards[i].byte_length for f, i in batch)

    todo = [k for k in _shard_reads(md) if md.tensors[k[0]].shards[k[1]].file_index not in missing]
    for fidx in sorted(missing):
        held = [fqn for fqn, t in md.tensors.items() if any(x.file_index == fidx for x in t.shards)]
        held += [b.key for b in md.blobs.values() if b.file_index == fidx]
        fail(
            f"MissingDataFileError: data file {storage.url}/{md.files[fidx]} is missing "
            f"(it holds {len(held)} tensors/blobs, e.g. {held[:3]})"
        )
    need = sum(-(-md.tensors[f].shards[i].byte_length // _ALIGN) * _ALIGN for f, i in todo)
    need = max([need] + [b.byte_length for b in md.blobs.values()])
    pool = torch.empty(min(need, batch_bytes) + _ALIGN, dtype=torch.uint8)  # the only buffer
    batch: list[tuple[str, int]] = []
    used = 0
    for fqn, sidx in todo:
        size = -(-md.tensors[fqn].shards[sidx].byte_length // _ALIGN) * _ALIGN
        if batch and used + size > batch_bytes:
            check(batch)
            batch, used = [], 0
        batch.append((fqn, sidx))
        used += size
    if batch:
        check(batch)
    for blob in sorted(md.blobs.values(), key=lambda b: b.key):
        if blob.file_index in missing:
            continue
        try:
            stream(md.files[blob.file_index], blob.byte_offset, blob.byte_length, blob.crc32c, f"blob {blob.key!r}")
        except CheckpointError as e:
            fail(f"{type(e).__name__}: {e}")
            continue
        report.blobs_checked += 1
        report.bytes_checked += blob.byte_length
    report.seconds = time.perf_counter() - t0
    return report


# ----------------------------------------------------------------------------------- rendering


def human_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'`` (binary units, one decimal; bytes as an integer)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    return f"{value:.1f} {unit}"


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells: tuple[str, ...]) -> str:
        return (
            "  "
            + "  ".join(
                c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
            ).rstrip()
        )

    return [line(header)] + [line(r) for r in rows]


def format_text(s: Summary, *, tensors: bool = True) -> str:
    """Human-readable report; ``tensors=False`` leaves out the per-tensor / per-file tables."""
    mesh = " x ".join(f"{n}={size}" for n, size in s.mesh) or "-"
    t = s.totals
    out = [
        f"unickpt checkpoint {s.path}",
        f"  format version  {s.format_version}",
        f"  save id         {s.save_id}",
        f"  created         {_iso(s.created_unix)}",
        f"  role            {s.role if s.role is not None else '-'}",
        f"  source          framework {s.framework}, world size {s.world_size}, mesh {mesh}",
        f"  totals          {_n(t.tensors, 'tensor')}, {_n(t.shards, 'shard')}, {human_bytes(t.tensor_bytes)} "
        f"tensor data ({t.tensor_bytes} bytes)",
        f"                  {_n(t.blobs, 'blob')} ({t.blob_bytes} bytes), {_n(t.files, 'file')} "
        f"({human_bytes(t.file_bytes)}, {t.file_bytes} bytes), metadata {t.metadata_bytes} bytes",
        f"  objects         {', '.join(s.objects) or '-'}",
    ]
    if tensors:
        out += ["", f"tensors ({t.tensors}):"]
        out += _table(
            ("FQN", "DTYPE", "SHAPE", "SHARDS", "BYTES"),
            [
                (x.fqn, x.dtype, "[" + ", ".join(map(str, x.shape)) + "]", str(x.shards), str(x.bytes))
                for x in s.tensors
            ],
            {3, 4},
        )
        out += ["", f"files ({t.files}):"]
        if s.sizes_checked:
            out += _table(("NAME", "BYTES", "ON DISK"), [(f.name, str(f.bytes), _disk(f)) for f in s.files], {1, 2})
        else:
            out += _table(("NAME", "BYTES"), [(f.name, str(f.bytes)) for f in s.files], {1})
        if s.blobs:
            out += ["", f"blobs ({t.blobs}):"]
            out += _table(("KEY", "FILE", "BYTES"), [(b.key, b.file, str(b.bytes)) for b in s.blobs], {2})
    problems = short_files(s)
    if problems:
        out += ["", f"WARNING: {len(problems)} data file(s) missing or shorter than the metadata says:"]
        out += [f"  {f.name}: {_disk(f)}, needs {f.bytes} bytes" for f in problems[:20]]
    if s.verify is not None:
        v = s.verify
        out.append("")
        status = "OK" if v.ok else f"FAILED ({_n(v.failures_total, 'problem')})"
        out.append(
            f"verify: {status}: {_n(v.shards_checked, 'shard')} and {_n(v.blobs_checked, 'blob')} checked, "
            f"{human_bytes(v.bytes_checked)} in {v.seconds:.2f} s"
        )
        out += [f"  {m}" for m in v.failures]
        if v.failures_total > len(v.failures):
            out.append(f"  ... and {v.failures_total - len(v.failures)} more")
    return "\n".join(out)


def short_files(s: Summary) -> list[FileInfo]:
    """Data files missing or shorter than the metadata says (when sizes were checked)."""
    return [f for f in s.files if f.size_on_disk is None or f.size_on_disk < f.bytes] if s.sizes_checked else []


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _disk(f: FileInfo) -> str:
    return "missing" if f.size_on_disk is None else str(f.size_on_disk)


def to_dict(s: Summary) -> dict[str, Any]:
    """JSON-ready dict; keys are stable (tools and tests parse them)."""
    return {
        "path": s.path,
        "format_version": s.format_version,
        "save_id": s.save_id,
        "created_unix": s.created_unix,
        "created": _iso(s.created_unix),
        "role": s.role,
        "topology": {"framework": s.framework, "world_size": s.world_size, "mesh": [[n, size] for n, size in s.mesh]},
        "totals": asdict(s.totals),
        "tensors": [
            {"fqn": t.fqn, "dtype": t.dtype, "shape": list(t.shape), "shards": t.shards, "bytes": t.bytes}
            for t in s.tensors
        ],
        "files": [asdict(f) for f in s.files],
        "blobs": [asdict(b) for b in s.blobs],
        "objects": list(s.objects),
        "sizes_checked": s.sizes_checked,
        "verify": None if s.verify is None else asdict(s.verify),
    }


def to_json(s: Summary) -> str:
    """One compact JSON document (``to_dict``)."""
    return json.dumps(to_dict(s), separators=(",", ":"))
