"""``unickpt inspect``: describe a checkpoint from its metadata alone, optionally verify its bytes.

Who calls what, in order (``cli.main`` -> ``run_inspect``):
  1. ``load_metadata(path)``  opens the storage (``open_storage``), reads the metadata bytes with
     ``folder.probe.read_metadata_bytes`` (which tells an interrupted save from a folder that is no
     checkpoint) and decodes / validates them with ``format.decode_metadata``; no data file is read;
  2. ``file_sizes(storage, md)``  stats every data file (one cheap ``size`` call each, in parallel),
     so missing or short files show up without reading them;
  3. ``summarize(md, ...)``  pure function: Metadata -> ``Summary`` (tensors, topology, files, blobs,
     totals). Unit tests call it directly on a decoded Metadata;
  4. optional ``verify(md, storage)`` (``tools.verify``)  reads every byte the metadata names and
     checks every checksum through reusable buffers, so memory stays fixed whatever sizes the
     metadata claims; it reports the first failures;
  5. ``format_text(summary)`` or ``to_json(summary)`` renders the result; every name from the
     checkpoint is passed through ``printable`` (text) or escaped by ``json.dumps`` (JSON).
Errors are unickpt ``CheckpointError``s; the CLI prints each as one line and exits with code 1.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from ..coordination.single import SingleProcessCoordinator
from ..folder.probe import read_metadata_bytes
from ..format import METADATA_FILE, Metadata, decode_metadata
from ..storage import Storage, open_storage
from ..storage.base import METADATA_LIMIT
from .printable import printable
from .verify import VerifyReport, verify

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
        f"unickpt checkpoint {printable(s.path)}",
        f"  format version  {s.format_version}",
        f"  save id         {printable(s.save_id)}",
        f"  created         {_iso(s.created_unix)}",
        f"  role            {printable(s.role) if s.role is not None else '-'}",
        f"  source          framework {printable(s.framework)}, world size {s.world_size}, mesh {printable(mesh)}",
        f"  totals          {_n(t.tensors, 'tensor')}, {_n(t.shards, 'shard')}, {human_bytes(t.tensor_bytes)} "
        f"tensor data ({t.tensor_bytes} bytes)",
        f"                  {_n(t.blobs, 'blob')} ({t.blob_bytes} bytes), {_n(t.files, 'file')} "
        f"({human_bytes(t.file_bytes)}, {t.file_bytes} bytes), metadata {t.metadata_bytes} bytes",
        f"  objects         {', '.join(map(printable, s.objects)) or '-'}",
    ]
    if tensors:
        out += ["", f"tensors ({t.tensors}):"]
        out += _table(
            ("FQN", "DTYPE", "SHAPE", "SHARDS", "BYTES"),
            [
                (printable(x.fqn), x.dtype, "[" + ", ".join(map(str, x.shape)) + "]", str(x.shards), str(x.bytes))
                for x in s.tensors
            ],
            {3, 4},
        )
        out += ["", f"files ({t.files}):"]
        if s.sizes_checked:
            rows: list[tuple[str, ...]] = [(printable(f.name), str(f.bytes), _disk(f)) for f in s.files]
            out += _table(("NAME", "BYTES", "ON DISK"), rows, {1, 2})
        else:
            out += _table(("NAME", "BYTES"), [(printable(f.name), str(f.bytes)) for f in s.files], {1})
        if s.blobs:
            out += ["", f"blobs ({t.blobs}):"]
            blob_rows: list[tuple[str, ...]] = [(printable(b.key), printable(b.file), str(b.bytes)) for b in s.blobs]
            out += _table(("KEY", "FILE", "BYTES"), blob_rows, {2})
    problems = short_files(s)
    if problems:
        out += ["", f"WARNING: {len(problems)} data file(s) missing or shorter than the metadata says:"]
        out += [f"  {printable(f.name)}: {_disk(f)}, needs {f.bytes} bytes" for f in problems[:20]]
    if s.verify is not None:
        v = s.verify
        out.append("")
        status = "OK" if v.ok else f"FAILED ({_n(v.failures_total, 'problem')})"
        out.append(
            f"verify: {status}: {_n(v.shards_checked, 'shard')} and {_n(v.blobs_checked, 'blob')} checked, "
            f"{human_bytes(v.bytes_checked)} in {v.seconds:.2f} s"
        )
        out += [f"  {printable(m)}" for m in v.failures]
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
