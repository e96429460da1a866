"""Read-assignment test fixtures: metadata of 1-d uint8 tensors in one data file, and the
read assignment written plainly over Python lists (``assign_reads``, ``reference_parts``): the
oracle the coordinator's columnar assignment (``planning.read_columns``) is checked against."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from unickpt.format.layouts import SplitLayout, SplitShards, shard_location
from unickpt.format.records import Metadata, ShardRecord, TensorRecord, Topology
from unickpt.planning.read_assignment import ReadBatch, ShardKey


def split_metadata() -> Metadata:
    """One 8 x 2 float32 tensor ``a`` split in two parts over files ``f0`` and ``f1``."""
    lay = SplitLayout((0, 1), (("a", 4, (8, 2), 0),))
    tensors = {"a": TensorRecord("a", "float32", (8, 2), SplitShards(lay, 0))}
    return Metadata(3, "s", 1.0, Topology("fsdp2", 2), ("f0", "f1"), tensors)


def one_file_metadata(sizes: list[int]) -> Metadata:
    """Tensors ``t0, t1, ...`` of these sizes, one shard each, in file ``f`` one after the
    other (each at the next 64-byte boundary)."""
    tensors = {}
    pos = 0
    for i, n in enumerate(sizes):
        tensors[f"t{i}"] = TensorRecord(f"t{i}", "uint8", (n,), (ShardRecord((0,), (n,), 0, pos, n),))
        pos += -(-n // 64) * 64
    return Metadata(1, "x", 0.0, Topology("torch", 1), ("f",), tensors)


# ---------------------------------------------------------------- the reference read assignment
# The coordinator's read assignment as it was computed before it went columnar: a Python pass
# over every rank's needs (``disjoint_needs``), then ``assign_reads`` over the shared ones. The
# columnar coordinator (``engine.read_exchange.read_parts``) must give each rank the same part.


def reference_disjoint(md, by_rank, extent):
    """Shards several ranks need in pairwise disjoint rows whose reads' checksum chunks overlap
    by at most an eighth of what they cover together."""
    from unickpt.format.dtypes import itemsize
    from unickpt.format.layouts import shard_row_bytes

    ranges = {}
    for n in by_rank:
        for k, r in n.items():
            ranges.setdefault(k, []).append(r)
    out = set()
    for k, rs in ranges.items():
        if len(rs) < 2:
            continue
        rec = md.tensors[k[0]]
        file_index, offset, _ = shard_location(rec.shards, k[1])
        rb = shard_row_bytes(rec.shards, k[1], itemsize(rec.dtype))
        covers = sorted(extent(file_index, offset + a * rb, offset + b * rb) for a, b in rs)
        union, twice, end = 0, 0, -1
        for lo, hi in covers:
            twice += max(0, min(hi, end) - lo)
            union += max(0, hi - max(lo, end))
            end = max(end, hi)
        if 8 * twice <= union and all(b[0] >= a[1] for a, b in zip(sorted(rs), sorted(rs)[1:])):
            out.add(k)
    return out


def reference_parts(md, by_rank, hosts, dedup, page_cache, extent, max_batch_bytes=64 << 20):
    """Each rank's (batches or None, apart keys, shared-cache keys) from every rank's needs
    (``by_rank[r]``: {shard key: rows}, in report order)."""
    from dataclasses import replace

    count = {}
    for n in by_rank:
        for k in n:
            count[k] = count.get(k, 0) + 1
    if dedup is None and len(set(hosts)) == 1 and page_cache:
        return [(None, frozenset(), frozenset(k for k in n if count[k] > 1)) for n in by_rank]
    loads = [0] * len(by_rank)
    several = []
    for r, n in enumerate(by_rank):
        mine = {}
        for k, rows in n.items():
            if count[k] > 1:
                mine[k] = rows
            else:
                loads[r] += shard_location(md.tensors[k[0]].shards, k[1])[2]
        several.append(mine)
    apart = reference_disjoint(md, several, extent)
    needs = [[k for k in n if k not in apart] for n in several]
    chunk = getattr(md.checksums, "chunk_size", 0)
    least = 0
    if chunk:
        shared = {k for n in needs for k in n}
        nbytes = sum(shard_location(md.tensors[k[0]].shards, k[1])[2] for k in shared)
        least = max(4 * chunk, nbytes // (4 * max(1, len(needs))))
    batches = assign_reads(md, needs, max_batch_bytes, cover=extent, segment_bytes=least, loads=loads)
    mine = [[] for _ in by_rank]
    for b in batches:
        mine[b.reader].append(b)
        for c in b.consumers:
            if c != b.reader:
                mine[c].append(replace(b, consumers=(c,)))
    return [(tuple(m), frozenset(k for k in n if k in apart), frozenset()) for m, n in zip(mine, several)]


# ---------------------------------------------------------------- the rule over Python lists
# What the coordinator's columnar assignment (planning.read_columns) computes, written plainly:
# every needed shard read once, by one of its consumers, balanced by bytes, in chunk-aligned
# segments, batched per (reader, consumers).

_ALIGN = 64


Cover = Callable[[int, int, int], tuple[int, int]]  # (file, lo, hi) -> the bytes a read of [lo, hi) covers


def assign_reads(
    md: Metadata,
    needs: list[list[ShardKey]],
    max_batch_bytes: int = 64 << 20,
    cover: Cover | None = None,
    segment_bytes: int = 0,
    loads: list[int] | None = None,
) -> list[ReadBatch]:
    """Batches covering every needed shard exactly once, in a deterministic order. ``loads``:
    bytes each rank reads already (shards it alone needs, assigned elsewhere), counted by the
    balancing as if they were among ``needs``."""
    consumers: dict[ShardKey, list[int]] = defaultdict(list)
    for rank, keys in enumerate(needs):
        for k in dict.fromkeys(keys):
            consumers[k].append(rank)

    tensors = md.tensors
    where = {}  # key -> (file index, byte offset, byte length), looked up once
    for k in consumers:
        where[k] = shard_location(tensors[k[0]].shards, k[1])

    def size(k: ShardKey) -> int:
        return where[k][2]

    def location(k: ShardKey) -> tuple[int, int]:
        return where[k][:2]

    load = list(loads) if loads is not None else [0] * len(needs)
    reader: dict[ShardKey, int] = {}
    for k, cs in consumers.items():
        if len(cs) == 1:
            reader[k] = cs[0]
            load[cs[0]] += size(k)
    segments = _segments(
        where, sorted((k for k, cs in consumers.items() if len(cs) > 1), key=location), cover, segment_bytes
    )
    segments.sort(key=lambda seg: (-sum(size(k) for k in seg), location(seg[0])))
    for seg in segments:
        r = min({c for k in seg for c in consumers[k]}, key=lambda c: (load[c], c))
        for k in seg:
            reader[k] = r
            load[r] += size(k)

    groups: dict[tuple[int, tuple[int, ...]], list[ShardKey]] = defaultdict(list)
    for k in sorted(reader, key=location):
        groups[(reader[k], tuple(consumers[k]))].append(k)
    batches: list[ReadBatch] = []
    for (r, cons), keys in sorted(groups.items()):
        cur: list[ShardKey] = []
        offs: list[int] = []
        pos = 0
        for k in keys:
            n = size(k)
            if cur and pos + n > max_batch_bytes:
                batches.append(ReadBatch(len(batches), r, cons, tuple(cur), tuple(offs), pos))
                cur, offs, pos = [], [], 0
            cur.append(k)
            offs.append(pos)
            pos += -(-n // _ALIGN) * _ALIGN
        if cur:
            batches.append(ReadBatch(len(batches), r, cons, tuple(cur), tuple(offs), pos))
    return batches


def _segments(
    where: dict[ShardKey, tuple[int, int, int]], keys: list[ShardKey], cover: Cover | None, segment_bytes: int
) -> list[list[ShardKey]]:
    """``keys`` (in file order) cut into runs of one file of at least ``segment_bytes`` bytes,
    cut only where the next shard's covered bytes start after the current run's end
    (``where``: each key's file index, byte offset and byte length)."""
    out: list[list[ShardKey]] = []
    cur: list[ShardKey] = []
    cur_file, cur_bytes, cur_end = -1, 0, 0
    for k in keys:
        file_index, offset, length = where[k]
        end = offset + length
        lo, hi = cover(file_index, offset, end) if cover is not None else (offset, end)
        if cur and (file_index != cur_file or (cur_bytes >= segment_bytes and lo >= cur_end)):
            out.append(cur)
            cur, cur_bytes, cur_end = [], 0, 0
        cur.append(k)
        cur_file, cur_bytes, cur_end = file_index, cur_bytes + length, max(cur_end, hi)
    if cur:
        out.append(cur)
    return out
