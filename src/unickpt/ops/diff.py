"""``unickpt diff A B``: compare two checkpoints tensor by tensor (any saved parallelism each).

``diff(a, b)`` decodes both metadata files (``inspect.load_metadata``), compares
the key sets and each common tensor's dtype and shape from the metadata alone, then reads the
common tensors one pair at a time, piece by piece (``pieces.iter_pieces``: the same boxes of at
most ``pieces.PIECE_BYTES`` from both, CRC32C checked) and compares them bit for bit, with the
largest absolute difference for floating-point tensors. The data files of both are checked
(``pieces.check_data_files``) before any read. Memory stays near two pieces, whatever the
tensors' sizes. Non-tensor objects (optimizer param groups) are compared as JSON. Key names are
passed through ``printable`` by whoever prints them (``cli.checkpoint``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..planning.load.shards import ShardIndex
from .inspect import load_metadata
from .pieces import PIECE_BYTES, check_data_files, iter_pieces

__all__ = ["TensorDiff", "DiffReport", "diff"]


@dataclass(frozen=True, slots=True)
class TensorDiff:
    key: str
    what: str  # "dtype", "shape" or "values"
    detail: str


@dataclass(slots=True)
class DiffReport:
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    differ: list[TensorDiff] = field(default_factory=list)
    objects_differ: list[str] = field(default_factory=list)
    same: int = 0

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.differ or self.objects_differ)


def diff(
    a: str, b: str, *, keys: str | re.Pattern[str] | None = None, threads: int = 4, piece_bytes: int = PIECE_BYTES
) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (``keys``: only keys in which this regular expression
    is found, ``re.search``; plain text works too)."""
    sa, ma, _ = load_metadata(a)
    sb, mb, _ = load_metadata(b)
    rx = re.compile(keys) if isinstance(keys, str) else keys
    ka = {k for k in ma.tensors if rx is None or rx.search(k)}
    kb = {k for k in mb.tensors if rx is None or rx.search(k)}
    report = DiffReport(only_a=sorted(ka - kb), only_b=sorted(kb - ka))
    common = []
    for key in sorted(ka & kb):
        ra, rb = ma.tensors[key], mb.tensors[key]
        if ra.dtype != rb.dtype:
            report.differ.append(TensorDiff(key, "dtype", f"{ra.dtype} vs {rb.dtype}"))
        elif tuple(ra.shape) != tuple(rb.shape):
            report.differ.append(TensorDiff(key, "shape", f"{tuple(ra.shape)} vs {tuple(rb.shape)}"))
        else:
            common.append(key)
    check_data_files(sa, ma, common)
    check_data_files(sb, mb, common)
    ia, ib = ShardIndex(ma), ShardIndex(mb)
    for key in common:
        same, n, numel = True, 0, 0
        worst: torch.Tensor | None = None  # the largest |a - b| so far (NaN once any is NaN)
        pa = iter_pieces(ma, sa, key, threads=threads, piece_bytes=piece_bytes, index=ia)
        pb = iter_pieces(mb, sb, key, threads=threads, piece_bytes=piece_bytes, index=ib)
        for ta, tb in zip(pa, pb):
            numel += ta.numel()
            raw_a = ta.reshape(-1).view(torch.uint8) if ta.numel() else ta
            raw_b = tb.reshape(-1).view(torch.uint8) if tb.numel() else tb
            if not torch.equal(raw_a, raw_b):
                same = False
            n += int((ta != tb).sum())
            if ta.is_floating_point() and ta.numel():
                m = (ta.double() - tb.double()).abs().max()
                worst = m if worst is None else torch.maximum(worst, m)
        if same:
            report.same += 1
        elif worst is not None:
            detail = f"{n} of {numel} elements differ, max |a-b| {float(worst):.6g}"
            report.differ.append(TensorDiff(key, "values", detail))
        else:
            report.differ.append(TensorDiff(key, "values", f"{n} of {numel} elements differ"))
    report.differ.sort(key=lambda d: d.key)  # key order, whatever the kind of difference
    for name in sorted(set(ma.objects) | set(mb.objects)):
        if ma.objects.get(name) != mb.objects.get(name):
            report.objects_differ.append(name)
    return report
