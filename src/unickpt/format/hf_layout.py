"""The layout of a Hugging Face safetensors export, computed from shapes and dtypes alone.

Pure (no I/O, no collectives): ``ops.merge`` (the offline ``unickpt merge``) and
``engine.export.hf`` (every rank writes its share inside a save) both call ``plan_layout``, so
the two produce the same files byte for byte.

A safetensors file is: 8 bytes little-endian N, N bytes of JSON header (padded with spaces so
the data starts 8-byte aligned), then the tensors' bytes, row-major, back to back at the
header's ``data_offsets`` (relative to the data start). ``plan_layout`` assigns the tensors, in
the given order, to files of at most ``max_shard_bytes`` of data (a larger tensor gets a file of
its own); one file is ``model.safetensors``, several are ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` (``index_json``). ``box_runs`` gives the byte runs of a
box of a row-major tensor: where a rank's local shard lands in the file.

``HFExport`` is the option of ``SaveOptions.hf_export`` and ``unickpt.export_hf``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .hf_manifest import HF_FOLDER

__all__ = [
    "HFExport",
    "HF_FOLDER",
    "INDEX_FILE",
    "SAFETENSORS_DTYPES",
    "CAST_DTYPES",
    "FileLayout",
    "HFLayout",
    "out_dtype",
    "plan_layout",
    "index_json",
    "box_runs",
]

INDEX_FILE = "model.safetensors.index.json"
PRODUCER = "unickpt"
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
CAST_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, slots=True, kw_only=True)
class HFExport:
    """A Hugging Face export of the model's tensors (``model.*`` keys, named without ``model.``).

    ``dtype``: ``"fp32"``/``"fp16"``/``"bf16"`` casts floating-point tensors (None: as saved);
    ``max_shard_bytes``: the largest data size of one ``.safetensors`` file; ``config``: a
    ``config.json`` copied next to the weights (``transformers``' ``from_pretrained`` then loads
    the folder); ``key_map(name)``: renames (None drops the tensor; two names onto one refused);
    ``always_index``: write ``model.safetensors.index.json`` even for a single file."""

    dtype: str | None = None
    max_shard_bytes: int = 5 * 10**9
    config: str | None = None
    key_map: Callable[[str], str | None] | None = None
    always_index: bool = True

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in CAST_DTYPES:
            raise ValueError(f"HFExport.dtype must be None or one of {', '.join(CAST_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.max_shard_bytes, int) or self.max_shard_bytes < 1:
            raise ValueError(f"HFExport.max_shard_bytes must be a positive int, got {self.max_shard_bytes!r}")

    @property
    def cast(self) -> torch.dtype | None:
        return CAST_DTYPES[self.dtype] if self.dtype is not None else None


def out_dtype(src: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """The dtype ``src`` is written in: ``cast`` for floating point, else unchanged."""
    return cast if cast is not None and src.is_floating_point else src


@dataclass(frozen=True, slots=True)
class FileLayout:
    """One output file: its name, its full header (length prefix included) and, per tensor name,
    the absolute byte offset of its data in the file and its dtype and shape."""

    name: str
    header: bytes
    tensors: dict[str, tuple[int, torch.dtype, tuple[int, ...]]]
    size: int


@dataclass(frozen=True, slots=True)
class HFLayout:
    files: tuple[FileLayout, ...]
    total_size: int  # the data bytes of every file (the index's ``metadata.total_size``)

    def where(self) -> dict[str, tuple[int, int]]:
        """tensor name -> (file index, absolute data offset in that file)."""
        return {n: (i, at) for i, f in enumerate(self.files) for n, (at, _, _) in f.tensors.items()}


def _groups(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if groups[-1] and used + n > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += n
    return [g for g in groups if g] or [[]]


def _header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, list[int]]:
    header: dict[str, object] = {"__metadata__": {"format": "pt", "producer": PRODUCER}}
    starts = []
    at = 0
    for name, dtype, shape in entries:
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name!r} has dtype {dtype}, which safetensors cannot hold")
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        starts.append(at)
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw, starts


def plan_layout(
    tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_bytes: int, *, sharded_names: bool = False
) -> HFLayout:
    """The files of an export of ``tensors`` ((name, output dtype, shape), in file order).
    ``sharded_names``: name a single file ``model-00001-of-00001.safetensors`` too."""
    by_name = {n: (d, tuple(s)) for n, d, s in tensors}
    if len(by_name) != len(tensors):
        raise ValueError("plan_layout: a tensor name appears twice")
    sizes = [(n, math.prod(s) * d.itemsize) for n, d, s in tensors]
    groups = _groups(sizes, max_shard_bytes)
    files = []
    total = 0
    for i, group in enumerate(groups):
        single = len(groups) == 1 and not sharded_names
        fname = "model.safetensors" if single else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        entries = [(n, *by_name[n]) for n in group]
        header, starts = _header(entries)
        placed = {n: (len(header) + at, d, s) for (n, d, s), at in zip(entries, starts)}
        data = sum(math.prod(s) * d.itemsize for _, d, s in entries)
        files.append(FileLayout(fname, header, placed, len(header) + data))
        total += data
    return HFLayout(tuple(files), total)


def index_json(layout: HFLayout) -> bytes:
    """``model.safetensors.index.json`` of ``layout`` (sorted keys, 2-space indent)."""
    weight_map = {n: f.name for f in layout.files for n in f.tensors}
    index = {"metadata": {"total_size": layout.total_size}, "weight_map": weight_map}
    return json.dumps(index, indent=2, sort_keys=True).encode()


def box_runs(
    shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> Iterator[tuple[int, int]]:
    """(byte offset in the row-major tensor ``shape``, byte count) of each contiguous run of the
    box ``offsets``/``lengths``, in the box's own row-major order (so the box's local bytes,
    read in order, fill the runs one after another). A dim-0 box is one run; a box split along
    dim k gives one run per index of the dims before k. Empty boxes give no run."""
    nd = len(shape)
    if any(n == 0 for n in lengths):
        return
    if nd == 0:
        yield 0, itemsize
        return
    k = nd - 1  # the innermost dim the box does not span whole (all dims after it are whole)
    while k > 0 and lengths[k] == shape[k]:
        k -= 1
    inner = math.prod(shape[k + 1 :])  # elements per index of dim k
    run = lengths[k] * inner * itemsize
    strides = [math.prod(shape[d + 1 :]) for d in range(nd)]
    base = offsets[k] * inner
    outer = [range(offsets[d], offsets[d] + lengths[d]) for d in range(k)]
    if not outer:
        yield base * itemsize, run
        return
    for idx in _product(outer):
        yield (base + sum(i * s for i, s in zip(idx, strides))) * itemsize, run


def _product(ranges: list[range]) -> Iterator[tuple[int, ...]]:
    if len(ranges) == 1:
        for i in ranges[0]:
            yield (i,)
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)
