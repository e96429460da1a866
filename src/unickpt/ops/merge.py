"""``unickpt merge``: consolidate a checkpoint (any world size, any parallelism) into one full
state dict on disk: sharded safetensors with ``model.safetensors.index.json`` (optionally a
Hugging Face folder with its ``config.json``), or one ``torch.save`` file.

Steps of ``merge`` (``cli.export``, or a user):
  1. ``inspect.load_metadata(path)`` decodes the metadata (no data reads);
  2. ``select(md, model_only, key_map)`` picks the tensors and their output names (pure);
  3. ``plan_files(...)`` assigns them to output files of at most ``max_shard_bytes`` (pure; a
     tensor larger than that gets a file of its own);
  4. ``pieces.check_data_files`` stats the data files: a file missing or shorter than the
     metadata says (a metadata claiming more than was saved) is refused before anything is
     allocated or written;
  5. safetensors: each output file's header is built from the metadata alone, then every tensor
     is streamed into it piece by piece (``pieces.iter_pieces``: boxes of at most
     ``pieces.PIECE_BYTES`` contiguous in the output, each read through the load engine's
     ``read_stage``, CRC32C verified), cast piece by piece: peak memory is bounded by a few
     pieces (see ``pieces``), whatever the size of the tensors or of the checkpoint. Files are
     written under a temporary name and renamed when complete; the index is written last.
     torch: the whole dict is built in memory, then saved (``torch.save``): memory is the
     checkpoint's size.
Output goes to a new or empty folder only (files of an earlier merge are never overwritten).
Every output file (safetensors, torch, index, ``config.json``) is written under a temporary name
and renamed when complete (``output_files.OutputFiles``): a failure or Ctrl-C removes every file
of this merge, and a full disk is one ``StorageError`` naming the file.
Progress: a tqdm bar when ``progress`` (the CLI: stderr is a terminal), and ``report(line)``
after each output file (the CLI: stderr is not a terminal).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import torch

from ..coordination.single import SingleProcessCoordinator
from ..engine.load.stage import read_stage
from ..errors import ConfigurationError
from ..folder.target import prepare_output_folder, refuse_nested_output
from ..format import Metadata, dtype_from_name
from ..format.hf_layout import (
    CAST_DTYPES,
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    FileLayout,
    index_json,
    out_dtype,
    plan_layout,
)
from ..planning.load.overlap import CopyOp, shard_read
from ..planning.load.shards import ShardIndex
from ..planning.specs import LoadItem, ShardSpec
from ..storage import Storage
from .inspect import human_bytes, load_metadata
from .output_files import OutputFiles
from .pieces import PIECE_BYTES, check_data_files, iter_pieces
from .printable import quoted

__all__ = [
    "MergeResult",
    "read_full_tensor",
    "iter_full_tensors",
    "select",
    "merge",
    "parse_size",
    "SAFETENSORS_DTYPES",
]

_ONE = SingleProcessCoordinator()
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


@dataclass(frozen=True, slots=True)
class MergeResult:
    out: str
    files: tuple[str, ...]
    tensors: int
    bytes_written: int
    seconds: float = 0.0


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"512MiB"`` -> 512 * 2**20, ``"1000"`` -> 1000."""
    m = _SIZE.match(str(text))
    if m is None or _UNITS.get((m.group(2) or "").upper()) is None:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value < 1:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def read_full_tensor(md: Metadata, storage: Storage, fqn: str, threads: int = 4) -> torch.Tensor:
    """The whole tensor ``fqn`` of the checkpoint, assembled from every saved shard (checksums
    verified). Allocates exactly the tensor: callers check the data files first
    (``pieces.check_data_files``) so that a claim larger than the files allocates nothing."""
    rec = md.tensors.get(fqn)
    if rec is None:
        raise ConfigurationError(f"{storage.url} has no tensor {quoted(fqn)}")
    dtype = dtype_from_name(rec.dtype)
    out = torch.empty(tuple(rec.shape), dtype=dtype)
    zeros = (0,) * len(rec.shape)
    spec = ShardSpec(fqn, rec.dtype, rec.shape, zeros, tuple(rec.shape))
    reads = [
        shard_read(fqn, i, s, dtype.itemsize, (CopyOp(0, (0,) * len(s.lengths), tuple(s.offsets), tuple(s.lengths)),))
        for i, s in enumerate(rec.shards)
        if math.prod(s.lengths) > 0
    ]
    if reads:
        read_stage(
            md, storage, coord=_ONE, items=[LoadItem(spec, out)], reads=reads, threads=threads, verify=True, dedup=False
        )
    return out


def select(
    md: Metadata, model_only: bool = False, key_map: Callable[[str], str | None] | None = None
) -> dict[str, str]:
    """Checkpoint key -> output name, in checkpoint order. ``model_only``: only ``model.*``
    tensors, named without the ``model.`` prefix (the names ``nn.Module.state_dict`` and Hugging
    Face use). ``key_map(name)``: renames (None drops the tensor). Two tensors mapped to one
    name are refused."""
    chosen: dict[str, str] = {}
    seen: dict[str, str] = {}
    for key in md.tensors:
        if model_only:
            if not key.startswith("model."):
                continue
            name: str | None = key[len("model.") :]
        else:
            name = key
        if key_map is not None and name is not None:
            name = key_map(name)
        if name is None:
            continue
        if name in seen:
            raise ConfigurationError(
                f"merge: {quoted(seen[name])} and {quoted(key)} both map to the output name {quoted(name)}"
            )
        seen[name] = key
        chosen[key] = name
    return chosen


def iter_full_tensors(
    path: str, keys: list[str] | None = None, *, role: str | None = None, threads: int = 4
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, full tensor)`` one at a time (each read only when asked for; the data files are
    checked first, ``pieces.check_data_files``, so a claim larger than the files allocates
    nothing). Each tensor is allocated whole: ``pieces.iter_pieces`` reads in bounded pieces."""
    storage, md, _ = load_metadata(path, role)
    wanted = keys if keys is not None else list(md.tensors)
    check_data_files(storage, md, [k for k in wanted if k in md.tensors])
    for key in wanted:
        yield key, read_full_tensor(md, storage, key, threads)


_out_dtype = out_dtype


def _write_safetensors_file(
    f: BinaryIO,
    layout: FileLayout,
    keys: list[str],
    md: Metadata,
    storage: Storage,
    cast: torch.dtype | None,
    threads: int,
    progress: Callable[[int], None],
    index: ShardIndex,
    piece_bytes: int,
) -> int:
    """One safetensors file holding ``keys`` into ``f`` (``OutputFiles.stream``: a temporary name,
    renamed when complete): the header ``format.hf_layout`` computed from the metadata, then each
    tensor's bytes streamed piece by piece (module docstring); returns the file's size."""
    f.write(layout.header)
    for key in keys:
        for piece in iter_pieces(md, storage, key, threads=threads, piece_bytes=piece_bytes, index=index):
            t = piece.to(_out_dtype(piece.dtype, cast)).contiguous()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            progress(t.numel() * t.element_size())
            del t
    return layout.size


def merge(
    path: str,
    out: str,
    *,
    fmt: str = "safetensors",
    model_only: bool = False,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    hf_config: str | None = None,
    key_map: Callable[[str], str | None] | None = None,
    role: str | None = None,
    threads: int = 4,
    progress: bool = False,
    report: Callable[[str], None] | None = None,
    piece_bytes: int = PIECE_BYTES,
) -> MergeResult:
    """Consolidate the checkpoint at ``path`` into the new folder ``out`` (module docstring).

    ``fmt``: ``"safetensors"`` or ``"torch"``; ``dtype``: ``"fp32"``/``"fp16"``/``"bf16"`` casts
    floating-point tensors; ``hf_config``: a ``config.json`` copied next to the weights (implies
    ``model_only``), so ``transformers``' ``from_pretrained(out)`` loads the folder.
    ``progress``: a tqdm bar; ``report(line)``: called after each output file is complete;
    ``piece_bytes``: the largest piece of a tensor read at once (``pieces.PIECE_BYTES``)."""
    t0 = time.perf_counter()
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"merge: unknown format {fmt!r} (safetensors or torch)")
    if dtype is not None and dtype not in CAST_DTYPES:
        raise ValueError(f"merge: unknown dtype {dtype!r} (one of {', '.join(CAST_DTYPES)})")
    if hf_config is not None:
        model_only = True
        if not os.path.isfile(hf_config):
            raise ConfigurationError(f"merge: --hf-config {hf_config} is not a file")
    refuse_nested_output(path, out, "merge")
    cast = CAST_DTYPES[dtype] if dtype is not None else None
    storage, md, _ = load_metadata(path, role)
    names = select(md, model_only, key_map)
    if not names:
        raise ConfigurationError(f"merge: {storage.url} has no tensors to merge (model_only={model_only})")
    check_data_files(storage, md, names)
    prepare_output_folder(out, "merge")
    say = report if report is not None else (lambda line: None)
    sizes = {
        k: math.prod(md.tensors[k].shape) * _out_dtype(dtype_from_name(md.tensors[k].dtype), cast).itemsize
        for k in names
    }
    bar = _progress_bar(sum(sizes.values()), progress)
    files: list[str] = []
    written = 0
    try:
        with OutputFiles(out) as output:  # temporary names, renamed when complete; removed on failure
            if fmt == "torch":  # torch.save takes the whole dict: held in memory (data files checked above)
                full = {}
                for key, name in names.items():
                    t = read_full_tensor(md, storage, key, threads)
                    full[name] = t.to(_out_dtype(t.dtype, cast))
                    bar(sizes[key])
                target = "model.pt" if model_only else "checkpoint.pt"
                with output.stream(target) as f:
                    torch.save(full, f)
                    written = f.tell()
                files.append(target)
                say(f"wrote {os.path.join(out, target)} ({len(full)} tensors, {human_bytes(written)})")
            else:
                written = _write_safetensors(
                    output, names, md, storage, cast, max_shard_bytes, threads, bar, piece_bytes, files, say, t0
                )
            if hf_config is not None:
                with open(hf_config, "rb") as cf:
                    output.write("config.json", cf.read())
                files.append("config.json")
    finally:
        bar(None)
    return MergeResult(out, tuple(files), len(names), written, time.perf_counter() - t0)


def _write_safetensors(
    output: OutputFiles,
    names: dict[str, str],
    md: Metadata,
    storage: Storage,
    cast: torch.dtype | None,
    max_shard_bytes: int,
    threads: int,
    bar: Callable[[int], None],
    piece_bytes: int,
    files: list[str],
    say: Callable[[str], None],
    t0: float,
) -> int:
    """The safetensors files (and the index, when there are several) of ``merge``, into ``output``;
    returns the bytes of the safetensors files."""
    for key in names:
        if _out_dtype(dtype_from_name(md.tensors[key].dtype), cast) not in SAFETENSORS_DTYPES:
            raise ConfigurationError(
                f"merge: {quoted(key)} has dtype {md.tensors[key].dtype}, which safetensors cannot hold"
            )
    layout = plan_layout(
        [
            (name, _out_dtype(dtype_from_name(md.tensors[k].dtype), cast), tuple(md.tensors[k].shape))
            for k, name in names.items()
        ],
        max_shard_bytes,
    )
    key_of = {name: k for k, name in names.items()}
    shard_index = ShardIndex(md)
    written = 0
    for i, flay in enumerate(layout.files):
        group = [key_of[n] for n in flay.tensors]
        with output.stream(flay.name) as f:
            size = _write_safetensors_file(f, flay, group, md, storage, cast, threads, bar, shard_index, piece_bytes)
        written += size
        files.append(flay.name)
        say(
            f"wrote {flay.name} ({i + 1} of {len(layout.files)}: {len(group)} tensors, {human_bytes(size)}; "
            f"{time.perf_counter() - t0:.1f} s so far)"
        )
    if len(layout.files) > 1:
        output.write(INDEX_FILE, index_json(layout))
        files.append(INDEX_FILE)
    return written


def _progress_bar(total: int, enabled: bool) -> Callable[[int | None], None]:
    """``step(n)`` advances a tqdm bar by ``n`` bytes (``None`` closes it); a no-op when off or
    when tqdm is missing."""
    if not enabled:
        return lambda n: None
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda n: None
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="merge")

    def step(n: int | None) -> None:
        if n is None:
            bar.close()
        else:
            bar.update(n)

    return step
