"""Decode time of metadata whose tensors have many shards (the tiling check runs on every decode).

Layouts (each one float32 tensor, every shard in one data file, binary shard table):
- ``staircase N``: a crafted tiling of an (m, m) tensor, m = (N + 1) // 2: column i is split at
  row i into rows [0, i) and [i, m). A sweep over rows keeps all m columns open in every one of
  the m row slabs, which made the old recursive sweep quadratic (issue 9 item 10).
- ``rows N``: a regular row sharding into N shards of 8 rows (the common FSDP / TP case).
- ``grid N``: a sqrt(N) x sqrt(N) grid of 4 x 4 blocks (2-D tensor parallel).
- ``broken``: the staircase with one shard dropped, so the check fails and names the gap.

Prints one line per layout: shards, best-of-3 decode seconds. Usage:
    PYTHONPATH=src python bench/tiling_check.py [N ...]     (default 1000 4000 20000)
"""

from __future__ import annotations

import math
import sys
import time

from unickpt.errors import CorruptMetadataError
from unickpt.format.codec import decode_metadata, encode_metadata
from unickpt.format.records import Metadata, ShardRecord, TensorRecord, Topology

Box = tuple[tuple[int, int], tuple[int, int]]


def staircase(n: int) -> tuple[tuple[int, int], list[Box]]:
    m = (n + 1) // 2
    boxes: list[Box] = []
    for i in range(m):
        if i:
            boxes.append(((0, i), (i, 1)))
        boxes.append(((i, i), (m - i, 1)))
    return (m, m), boxes


def rows(n: int) -> tuple[tuple[int, int], list[Box]]:
    return (8 * n, 64), [((8 * i, 0), (8, 64)) for i in range(n)]


def grid(n: int) -> tuple[tuple[int, int], list[Box]]:
    s = math.isqrt(n)
    return (4 * s, 4 * s), [((4 * i, 4 * j), (4, 4)) for i in range(s) for j in range(s)]


def metadata(shape: tuple[int, int], boxes: list[Box]) -> bytes:
    shards, offset = [], 0
    for offs, lens in boxes:
        nbytes = math.prod(lens) * 4
        shards.append(ShardRecord(offs, lens, 0, offset, nbytes, 0))
        offset += nbytes
    md = Metadata(
        1,
        "bench",
        0.0,
        Topology("torch", 1),
        ("data/bench/r00000-00.bin",),
        {"w": TensorRecord("w", "float32", shape, tuple(shards))},
    )
    return encode_metadata(md)


def best_of(data: bytes, repeat: int = 3, budget_s: float = 120.0) -> tuple[float, str]:
    times, outcome = [], "ok"
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            decode_metadata(data, "bench")
        except CorruptMetadataError as e:
            outcome = str(e)[:110]
        times.append(time.perf_counter() - t0)
        if sum(times) > budget_s:
            break
    return min(times), outcome


def main(sizes: list[int]) -> None:
    print(f"{'layout':<12}{'shards':>8}{'decode s':>11}  outcome")
    for n in sizes:
        for name, make in (("staircase", staircase), ("rows", rows), ("grid", grid)):
            shape, boxes = make(n)
            secs, outcome = best_of(metadata(shape, boxes))
            print(f"{name:<12}{len(boxes):>8}{secs:>11.4f}  {outcome}", flush=True)
        shape, boxes = staircase(n)
        del boxes[len(boxes) // 2]
        secs, outcome = best_of(metadata(shape, boxes), repeat=1)
        print(f"{'broken':<12}{len(boxes):>8}{secs:>11.4f}  {outcome}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1000, 4000, 20000])
