"""Reading a Hugging Face safetensors folder for ``unickpt convert --from hf`` without trusting it.

``ops.convert.from_hf`` calls :func:`hf_shard_names` (the files of ``model.safetensors.index.json``'s
``weight_map``, or ``model.safetensors``), then :func:`load_shard` per file. Every file is opened
by ``ops.source_files.open_regular`` (a regular file inside the folder: no link, no FIFO, which
would block a plain open forever); the index is read only up to ``HF_INDEX_LIMIT`` bytes, a
shard's JSON header only up to ``SAFETENSORS_HEADER_LIMIT`` bytes, both checked before reading.
The shard is then read by ``safetensors`` through the descriptor already checked
(``/proc/self/fd/N``), so the file read is the one checked even if the name is swapped meanwhile;
``safetensors`` checks that every tensor's bytes lie inside the file. :func:`load_shards` reads
them all and refuses a tensor name found in two shards (never the last one read wins). Every
refusal is a ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..errors import CheckpointError, ConfigurationError, CorruptMetadataError, NotACheckpointError, SizeLimitError
from .source_files import check_relative_name, open_regular, read_range, read_small_file

__all__ = ["HF_INDEX", "HF_INDEX_LIMIT", "SAFETENSORS_HEADER_LIMIT", "hf_shard_names", "load_shard", "load_shards"]

HF_INDEX = "model.safetensors.index.json"
HF_INDEX_LIMIT = 64 << 20  # bytes of the index JSON read at most (a 405B model's index: ~100 KB)
SAFETENSORS_HEADER_LIMIT = 100_000_000  # bytes of a shard's JSON header (safetensors' own cap)


def hf_shard_names(folder: str) -> tuple[list[str], str]:
    """The safetensors files of ``folder`` (sorted, each a plain relative path) and the file that
    named them (the index, or the folder for a lone ``model.safetensors``)."""
    index = os.path.join(folder, HF_INDEX)
    if not os.path.lexists(index):
        if os.path.lexists(os.path.join(folder, "model.safetensors")):
            return ["model.safetensors"], folder
        raise NotACheckpointError(f"{folder} has neither model.safetensors nor {HF_INDEX}")
    raw = read_small_file(folder, HF_INDEX, HF_INDEX_LIMIT, f"the Hugging Face folder {folder}")
    try:
        weight_map = json.loads(raw)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptMetadataError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    if type(weight_map) is not dict or not all(type(v) is str for v in weight_map.values()):
        raise CorruptMetadataError(f"{index}: weight_map is not a mapping of tensor names to file names")
    names = sorted(set(weight_map.values()))
    for name in names:
        check_relative_name(name, folder, index)
    return names, index


def load_shard(folder: str, name: str, where: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``folder/name`` (named by ``where``), read as the
    module docstring says."""
    from safetensors.torch import load_file

    path = os.path.join(folder, name)
    with open_regular(folder, name, where) as (fd, size):
        head = read_range(fd, size, 0, 8, path, "the safetensors header length")
        header = int.from_bytes(head, "little")
        if header > SAFETENSORS_HEADER_LIMIT:
            raise SizeLimitError(
                f"{path} says its safetensors header holds {header} bytes, over the cap of "
                f"{SAFETENSORS_HEADER_LIMIT} bytes: refused"
            )
        if 8 + header > size:
            raise CorruptMetadataError(f"{path} says its header holds {header} bytes, but the file holds {size}")
        try:
            tensors: dict[str, Any] = load_file(_fd_path(fd))
        except CheckpointError:
            raise
        except Exception as e:  # SafetensorError, and what a malformed header raises
            raise CorruptMetadataError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    return tensors


def load_shards(folder: str, names: list[str], where: str) -> dict[str, torch.Tensor]:
    """Every tensor of the shards ``names`` of ``folder`` (from :func:`hf_shard_names`), by name;
    ``CorruptMetadataError`` naming both files when two shards hold a tensor of the same name."""
    tensors: dict[str, torch.Tensor] = {}
    found_in: dict[str, str] = {}
    for name in names:
        for key, tensor in load_shard(folder, name, where).items():
            if key in found_in:
                raise CorruptMetadataError(
                    f"{os.path.join(folder, name)} and {os.path.join(folder, found_in[key])} both hold a tensor "
                    f"named {key!r}: refused (which one is the model's cannot be told; remove one)"
                )
            tensors[key], found_in[key] = tensor, name
    return tensors


def _fd_path(fd: int) -> str:
    """A name that opens the file ``fd`` refers to, whatever is at its path now."""
    for base in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(base):
            return f"{base}/{fd}"
    raise ConfigurationError("convert --from hf needs /proc/self/fd or /dev/fd to read a checked file")
