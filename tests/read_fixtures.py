"""Test metadata: 1-d uint8 tensors in one data file (read-assignment tests)."""

from __future__ import annotations

from unickpt.format.records import Metadata, ShardRecord, TensorRecord, Topology


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
    from unickpt.format.layouts import shard_location, shard_row_bytes

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

    from unickpt.format.layouts import shard_location
    from unickpt.planning.read_assignment import assign_reads

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
