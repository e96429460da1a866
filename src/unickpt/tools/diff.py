"""``unickpt diff A B``: compare two checkpoints tensor by tensor (any saved parallelism each).

Who calls what: ``diff(a, b)`` decodes both metadata files (``inspect.load_metadata``), compares
the key sets and each common tensor's dtype and shape from the metadata alone, then reads the
common tensors one pair at a time (``merge.read_full_tensor``: CRC32C checked) and compares
them bit for bit, with the largest absolute difference for floating-point tensors. Memory stays
near two copies of the largest tensor. Non-tensor objects (optimizer param groups) are compared
as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .inspect import load_metadata
from .merge import read_full_tensor

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


def diff(a: str, b: str, *, keys: str | None = None, threads: int = 4) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (``keys``: only keys containing this substring)."""
    sa, ma, _ = load_metadata(a)
    sb, mb, _ = load_metadata(b)
    ka = {k for k in ma.tensors if keys is None or keys in k}
    kb = {k for k in mb.tensors if keys is None or keys in k}
    report = DiffReport(only_a=sorted(ka - kb), only_b=sorted(kb - ka))
    for key in sorted(ka & kb):
        ra, rb = ma.tensors[key], mb.tensors[key]
        if ra.dtype != rb.dtype:
            report.differ.append(TensorDiff(key, "dtype", f"{ra.dtype} vs {rb.dtype}"))
            continue
        if tuple(ra.shape) != tuple(rb.shape):
            report.differ.append(TensorDiff(key, "shape", f"{tuple(ra.shape)} vs {tuple(rb.shape)}"))
            continue
        ta = read_full_tensor(ma, sa, key, threads)
        tb = read_full_tensor(mb, sb, key, threads)
        raw_a = ta.reshape(-1).view(torch.uint8) if ta.numel() else ta
        raw_b = tb.reshape(-1).view(torch.uint8) if tb.numel() else tb
        if torch.equal(raw_a, raw_b):
            report.same += 1
            continue
        if ta.is_floating_point():
            delta = (ta.double() - tb.double()).abs()
            n = int((ta != tb).sum())
            report.differ.append(
                TensorDiff(key, "values", f"{n} of {ta.numel()} elements differ, max |a-b| {float(delta.max()):.6g}")
            )
        else:
            n = int((ta != tb).sum())
            report.differ.append(TensorDiff(key, "values", f"{n} of {ta.numel()} elements differ"))
    for name in sorted(set(ma.objects) | set(mb.objects)):
        if ma.objects.get(name) != mb.objects.get(name):
            report.objects_differ.append(name)
    return report
