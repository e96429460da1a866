"""Object collectives over a gloo group in one round when the objects are small.

``torch.distributed``'s object collectives take two rounds each (the sizes, then the padded
bytes). Almost everything unickpt's coordinators exchange is small (a stage's outcome, a rank's
claims, a choice): a few hundred bytes. Here each rank's object travels in a fixed *slot*
(``slot_bytes``: 4 KiB up to 64 ranks, less above, 512 bytes at least) whose first 8 bytes are the
pickled object's length; when the object fits after them, one collective delivers it. A larger
object (the metadata, a big plan) costs one more transfer, and only where the first round showed
it is needed:

- ``all_gather``: every rank sees every length, so all run a second all_gather of the longest;
- ``broadcast``: every rank sees the source's length, so all run a second broadcast of its bytes;
- ``gather``: only the destination sees the lengths; each rank whose object did not fit sends it
  to the destination point to point (tag ``TAG``), which receives from exactly those ranks;
- ``scatter``: each receiver sees its own length; the source sends the objects that did not fit
  point to point (tag ``TAG``) and each of their receivers receives its own.

On a 2-core machine with 4 ranks a small all_gather takes 3.4 ms against torch's 6.3 ms
(``bench/object_collectives.py``; docs/performance.md, "Checksums and round trips").

Callers: ``coordination.torch_dist`` (``TorchDistCoordinator`` and the tree's ``GroupLink``),
inside their failure handling, and the RAM tier's group (``recovery.group.TierGroup``: JSON
values and raw bytes); every rank of ``group`` calls the same function in the same order. The
coordinators' objects are unickpt's own records between live ranks of one job, pickled as
torch's object collectives pickle them (``PICKLE``); never data read from a checkpoint, which
the RAM tier exchanges as JSON (``JSON``) or as the bytes they are (``RAW``). ``TAG`` is reserved on
unickpt's groups (the load's forwarded batches and the RAM tier's transfers use other tags).
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "slot_bytes",
    "all_gather",
    "broadcast",
    "gather",
    "scatter",
    "Codec",
    "PICKLE",
    "JSON",
    "RAW",
    "TAG",
    "HEADER",
]

HEADER = 8  # little-endian int64: the length of the pickled object
TAG = 0x7FFF_FF00  # point-to-point transfers of the objects that did not fit their slot


def slot_bytes(world_size: int) -> int:
    """The bytes each rank's object travels in at ``world_size`` (the same on every rank): 4 KiB up
    to 64 ranks, then 256 KiB spread over the ranks, 512 bytes at least."""
    return max(512, min(4096, (256 << 10) // max(1, world_size)))


@dataclass(frozen=True, slots=True)
class Codec:
    """How an object becomes the bytes that travel, and back."""

    dumps: Callable[[Any], bytes]
    loads: Callable[[memoryview], Any]


PICKLE = Codec(lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads)
JSON = Codec(lambda o: json.dumps(o, separators=(",", ":")).encode(), lambda b: json.loads(bytes(b)))
RAW = Codec(bytes, bytes)  # bytes, sent as they are


def _slot(data: bytes, slot: int) -> torch.Tensor:
    """The slot holding ``data``'s length, and ``data`` when it fits."""
    buf = bytearray(slot)
    struct.pack_into("<q", buf, 0, len(data))
    if len(data) <= slot - HEADER:
        buf[HEADER : HEADER + len(data)] = data
    return torch.frombuffer(buf, dtype=torch.uint8)


def _length(buf: torch.Tensor) -> int:
    return int(struct.unpack_from("<q", buf.numpy().data, 0)[0])


def _fits(n: int, slot: int) -> bool:
    return n <= slot - HEADER


def _in_slot(buf: torch.Tensor, n: int, codec: Codec) -> Any:
    return codec.loads(buf.numpy().data[HEADER : HEADER + n])


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def all_gather(group: dist.ProcessGroup, world_size: int, obj: Any, codec: Codec = PICKLE) -> list[Any]:
    """Every rank's ``obj``, in rank order (copies, also of this rank's)."""
    slot = slot_bytes(world_size)
    data = codec.dumps(obj)
    outs = [torch.empty(slot, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(outs, _slot(data, slot), group=group)
    lengths = [_length(o) for o in outs]
    longest = max(lengths)
    if _fits(longest, slot):
        return [_in_slot(o, n, codec) for o, n in zip(outs, lengths)]
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = _bytes_tensor(data)
    full = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(full, padded, group=group)
    return [codec.loads(f.numpy().data[:n]) for f, n in zip(full, lengths)]


def broadcast(
    group: dist.ProcessGroup, world_size: int, obj: Any, src: int, is_src: bool, codec: Codec = PICKLE
) -> Any:
    """The source's ``obj`` on every rank (``src``: its global rank; the source gets ``obj``
    itself back)."""
    slot = slot_bytes(world_size)
    data = codec.dumps(obj) if is_src else b""
    buf = _slot(data, slot) if is_src else torch.empty(slot, dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    n = _length(buf)
    if _fits(n, slot):
        return obj if is_src else _in_slot(buf, n, codec)
    full = _bytes_tensor(data) if is_src else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(full, src=src, group=group)
    return obj if is_src else codec.loads(full.numpy().data)


def gather(
    group: dist.ProcessGroup,
    world_size: int,
    obj: Any,
    dst: int,
    is_dst: bool,
    global_ranks: list[int],
    codec: Codec = PICKLE,
) -> list[Any] | None:
    """Every rank's ``obj`` on the destination (``dst``: its global rank), in rank order; None
    elsewhere. ``global_ranks``: the group's ranks' global ranks."""
    slot = slot_bytes(world_size)
    data = codec.dumps(obj)
    outs = [torch.empty(slot, dtype=torch.uint8) for _ in range(world_size)] if is_dst else None
    dist.gather(_slot(data, slot), gather_list=outs, dst=dst, group=group)
    if not is_dst:
        if not _fits(len(data), slot):
            dist.send(_bytes_tensor(data), dst=dst, group=group, tag=TAG)
        return None
    assert outs is not None
    got: list[Any] = []
    for r, o in enumerate(outs):
        n = _length(o)
        if _fits(n, slot):
            got.append(_in_slot(o, n, codec))
        elif global_ranks[r] == dst:
            got.append(codec.loads(memoryview(data)))
        else:
            full = torch.empty(n, dtype=torch.uint8)
            dist.recv(full, src=global_ranks[r], group=group, tag=TAG)
            got.append(codec.loads(full.numpy().data))
    return got


def scatter(
    group: dist.ProcessGroup,
    world_size: int,
    objs: list[Any] | None,
    src: int,
    is_src: bool,
    global_ranks: list[int],
    codec: Codec = PICKLE,
) -> Any:
    """Object ``r`` of the source's ``objs`` on group rank ``r`` (a copy; ``src``: the source's
    global rank)."""
    slot = slot_bytes(world_size)
    datas = [codec.dumps(o) for o in objs] if is_src and objs is not None else None
    assert not is_src or (datas is not None and len(datas) == world_size), "one object per rank on the source"
    out = torch.empty(slot, dtype=torch.uint8)
    slots = [_slot(d, slot) for d in datas] if datas is not None else None
    dist.scatter(out, scatter_list=slots, src=src, group=group)
    n = _length(out)
    if datas is not None:
        works = [
            dist.isend(_bytes_tensor(d), dst=g, group=group, tag=TAG)
            for d, g in zip(datas, global_ranks)
            if g != src and not _fits(len(d), slot)
        ]
        for w in works:
            assert w is not None  # None only for a rank outside ``group``
            w.wait()
        mine = global_ranks.index(src)
        return codec.loads(memoryview(datas[mine]))
    if _fits(n, slot):
        return _in_slot(out, n, codec)
    full = torch.empty(n, dtype=torch.uint8)
    dist.recv(full, src=src, group=group, tag=TAG)
    return codec.loads(full.numpy().data)
