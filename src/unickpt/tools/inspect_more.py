"""The parts of ``unickpt inspect`` that look deeper than the summary: bytes per saving rank,
the shard layout of one tensor, a tensor's values (what ByteCheckpoint's ``load_ckpt.py`` is
used for), and the non-tensor state (dataloader, extra state). Names from the checkpoint are
printed through ``printable``.

Called by ``cli._cmd_inspect`` after ``inspect.summarize``; each function takes the decoded
``Metadata`` (and the storage where data must be read) and returns lines of text.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable

import torch

from ..format import Metadata, dtype_from_name
from ..storage import Storage
from .pieces import PIECE_BYTES, check_data_files, iter_pieces
from .printable import printable, quoted

__all__ = ["rank_bytes_lines", "shard_lines", "value_lines", "state_lines", "key_filter"]

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
