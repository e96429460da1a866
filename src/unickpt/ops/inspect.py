"""``unickpt inspect``: describe a checkpoint from its metadata alone, optionally verify its bytes,
and look deeper where asked (bytes per saving rank, one tensor's shards or values, the non-tensor
state).

Order of use (``cli.checkpoint``, or a user):
  1. ``load_metadata(path)``  opens the storage (``open_storage``), reads the metadata bytes with
     ``folder.probe.read_metadata_bytes`` (which tells an interrupted save from a folder that is no
     checkpoint) and decodes / validates them with ``format.decode_metadata``; no data file is read;
  2. ``file_sizes(storage, md)`` (``ops.verify``)  stats every data file (one cheap ``size`` call each, in parallel),
     so missing or short files show up without reading them;
  3. ``summarize(md, ...)``  pure function: Metadata -> ``Summary`` (tensors, topology, files, blobs,
     totals). Unit tests call it directly on a decoded Metadata;
  4. optional ``verify(md, storage)`` (``ops.verify``)  reads every byte the metadata names and
     checks every checksum through reusable buffers, so memory stays fixed whatever sizes the
     metadata claims; it reports the first failures;
  5. ``format_text(summary)`` or ``to_json(summary)`` renders the result; every name from the
     checkpoint is passed through ``printable`` (text) or escaped by ``json.dumps`` (JSON);
  6. the deeper views, each Metadata (and the storage where data is read) -> lines of text:
     ``state_lines``, ``rank_bytes_lines``, ``shard_lines(key)``, ``value_lines(key)`` (read piece
     by piece, ``ops.pieces``); ``key_filter`` is ``--key``.
Errors are unickpt ``CheckpointError``s; the CLI prints each as one line and exits with code 1.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..coordination.single import SingleProcessCoordinator
from ..folder.files import expected_sizes
from ..folder.probe import read_metadata_bytes
from ..format import METADATA_FILE, Metadata, decode_metadata, dtype_from_name
from ..storage import Storage, open_storage
from ..storage.base import METADATA_LIMIT
from .pieces import PIECE_BYTES, check_data_files, iter_pieces
from .printable import printable, quoted
from .verify import VerifyReport, file_sizes, verify

if TYPE_CHECKING:
    import torch

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
    "rank_bytes_lines",
    "shard_lines",
    "value_lines",
    "state_lines",
    "key_filter",
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


def summarize(
    md: Metadata, path: str = "", sizes: dict[str, int | None] | None = None, metadata_bytes: int = 0
) -> Summary:
    """Pure: the human/JSON view of ``md``. ``sizes`` (from ``file_sizes``) adds on-disk sizes."""
    tensors = [
        TensorInfo(t.fqn, t.dtype, tuple(t.shape), len(t.shards), sum(s.byte_length for s in t.shards))
        for t in md.tensors.values()
    ]
    ends = expected_sizes(md)  # what each file must hold (``folder.files``' rule)
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
        out += [f"  note: {printable(m)}" for m in v.notes]
        if v.failures_total > len(v.failures):
            out.append(f"  ... and {v.failures_total - len(v.failures)} more")
    return "\n".join(out)


def short_files(s: Summary) -> list[FileInfo]:
    """Data files missing or shorter than the metadata says (when sizes were checked): the
    incomplete ones of ``folder.files``' rule (a longer file is complete)."""
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


# ------------------------------------------------------------------ deeper views (--shards, --values ...)


_RANK = re.compile(r"(?:^|/)r(\d{5,})-\d+\.bin$")


def key_filter(pattern: str | re.Pattern[str] | None) -> Callable[[str], bool]:
    """``--key``: a regular expression searched in each key (plain text works too); the CLI
    compiles it while parsing the arguments (a bad one is a usage error)."""
    if pattern is None:
        return lambda key: True
    rx = re.compile(pattern) if isinstance(pattern, str) else pattern
    return lambda key: rx.search(key) is not None


def rank_bytes_lines(md: Metadata) -> list[str]:
    """Bytes written by each saving rank (from the data file names ``r<rank>-<n>.bin``)."""
    per_file: dict[int, int] = defaultdict(int)
    for t in md.tensors.values():
        for s in t.shards:
            per_file[s.file_index] += s.byte_length
    for b in md.blobs.values():
        per_file[b.file_index] += b.byte_length
    per_rank: dict[int, int] = defaultdict(int)
    for fidx, n in per_file.items():
        m = _RANK.search(md.files[fidx])
        per_rank[int(m.group(1)) if m else -1] += n
    if not per_rank:
        return []
    mean = sum(per_rank.values()) / len(per_rank)
    lines = ["", "bytes per saving rank:", "  RANK           BYTES  / MEAN"]
    for r in sorted(per_rank):
        name = str(r) if r >= 0 else "?"
        lines.append(f"  {name:>4}  {per_rank[r]:>14}  {per_rank[r] / mean if mean else 0:6.3f}")
    return lines


def shard_lines(md: Metadata, key: str) -> list[str]:
    rec = md.tensors.get(key)
    if rec is None:
        return [f"no tensor {quoted(key)} (see the tensor table)"]
    lines = ["", f"shards of {printable(key)} ({rec.dtype}, shape {list(rec.shape)}, {len(rec.shards)} shards):"]
    head = "  OFFSETS                LENGTHS                FILE                              BYTE OFFSET   BYTES"
    lines.append(head + "  CHECKSUMS")
    for s in rec.shards:
        end = s.byte_offset + s.byte_length
        units = md.checksums.cover(s.file_index, s.byte_offset, end) if md.checksums else None
        sums = (
            "-"
            if units is None
            else ", ".join(f"{c:#010x}" for c in units.crcs[:2])
            + (f" +{len(units.crcs) - 2}" if len(units.crcs) > 2 else "")
        )
        lines.append(
            f"  {list(s.offsets)!s:22s} {list(s.lengths)!s:22s} {printable(md.files[s.file_index]):33s} "
            f"{s.byte_offset:>11} {s.byte_length:>7}  {sums}"
        )
    return lines


def value_lines(md: Metadata, storage: Storage, key: str, first: int = 10, piece_bytes: int = PIECE_BYTES) -> list[str]:
    """Statistics and the first elements of tensor ``key``, read piece by piece
    (``pieces.iter_pieces``, checksums verified; the data files checked first): memory stays at
    a piece whatever size the metadata claims. The mean and standard deviation are combined
    across pieces (Chan et al.'s pairwise update, in float64)."""
    if key not in md.tensors:
        return [f"no tensor {quoted(key)} (see the tensor table)"]
    import torch  # only --values reads tensors: the rest of inspect runs without torch

    rec = md.tensors[key]
    check_data_files(storage, md, [key])
    dtype = dtype_from_name(rec.dtype)
    numeric = dtype.is_floating_point or dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
    head: list[object] = []
    count, mean, m2, bad = 0, 0.0, 0.0, 0
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    for piece in iter_pieces(md, storage, key, piece_bytes=piece_bytes):
        flat = piece.reshape(-1)
        if len(head) < first:
            head += flat[: first - len(head)].tolist()
        if not numeric or not flat.numel():
            continue
        d = flat.double()
        n = d.numel()
        p_mean = float(d.mean())
        p_m2 = float(((d - p_mean) ** 2).sum())
        delta = p_mean - mean
        total = count + n
        mean += delta * n / total
        m2 += p_m2 + delta * delta * count * n / total
        count = total
        bad += int((~torch.isfinite(d)).sum())
        lo = d.min() if lo is None else torch.minimum(lo, d.min())
        hi = d.max() if hi is None else torch.maximum(hi, d.max())
    numel = math.prod(rec.shape)
    lines = ["", f"values of {printable(key)} ({dtype}, shape {list(rec.shape)}, {numel} elements):"]
    if count and lo is not None and hi is not None:
        std = math.sqrt(m2 / (count - 1)) if count > 1 and math.isfinite(m2) else (0.0 if count == 1 else math.nan)
        lines.append(f"  min {float(lo):.6g}  max {float(hi):.6g}  mean {mean:.6g}  std {std:.6g}  non-finite {bad}")
    lines.append(f"  first {min(first, numel)}: {head}")
    return lines


def state_lines(md: Metadata) -> list[str]:
    """The dataloader section and the extra-state / loader blobs."""
    lines: list[str] = []
    loader = md.sections.get("dataloader")
    if loader is not None:
        lines.append(f"  dataloader      unickpt.data state: {loader.num_parts} parts + replicated part")  # type: ignore[attr-defined]
    legacy = sorted(k for k in md.blobs if k.startswith("dataloader/rank"))
    if legacy:
        lines.append(f"  dataloader      per-rank state_dict of {len(legacy)} rank(s) (same world size only)")
    extra = sorted(k for k in md.blobs if k.startswith("extra_state/"))
    if extra:
        lines.append(
            f"  extra state     {len(extra)} per-rank blob(s), {sum(md.blobs[k].byte_length for k in extra)} bytes"
        )
    return ["", "non-tensor state:", *lines] if lines else []
