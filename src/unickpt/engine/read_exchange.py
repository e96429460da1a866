"""The exchange of a distributed load's needs: gathered at the coordinator, each rank told only
its own part.

Called by ``read.read_stage`` when reads are deduplicated across ranks (several ranks,
``LoadOptions.dedup_reads`` not False). Order: every rank sends the coordinator (rank 0; up the
tree when the job's coordinator is a tree) its host name and, as one ``NEED_DTYPE`` row each,
the rows of each saved shard it needs (``report_needs``: 24 bytes a need) -> the coordinator
decides once for the job (``read_parts``, columnar: ``planning.read_columns``): on one host over
storage that shares its page cache (``dedup_reads=None``), nothing is forwarded and each rank
learns which of its shards others read too; otherwise shards several ranks need in disjoint
rows are read by each for its own rows, and every other shard several ranks need is assigned
to one reader (``planning.read_assignment``'s rule, balanced with the bytes each rank reads alone) -> each
rank receives only its part (``PartWire``: the batches it reads or receives, a received batch
naming it as its only consumer, keys as tensor numbers; bit masks over its own report for the
shards it reads apart or through the shared cache) and decodes it (``decode_part``); the shards
it alone needs it reads itself, unbatched (``own_keys``). A rank's part grows with its own shared
needs (and, for a batch it reads for others, their number), never with the job's; the
coordinator's work is numpy passes over every need plus a Python step per segment and batch. A
failure at the coordinator reaches every rank as the same error.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..coordination.base import Coordinator
from ..errors import CheckpointError, PlanningError
from ..format.records import Metadata
from ..planning.load_plan import ShardRead
from ..planning.read_assignment import ReadBatch, ShardKey
from ..planning.read_columns import NEED_DTYPE, Extents, JobNeeds, assign_columns, classify
from .page_advice import huge_pages_off

__all__ = [
    "ReadPart",
    "exchange_needs",
    "report_needs",
    "read_parts",
    "decode_part",
    "own_keys",
    "vectorized",
]

Rows = tuple[int, int]  # the rows of a saved shard a rank's copies touch
Extent = Callable[[int, int, int], tuple[int, int]]  # (file, lo, hi) -> the bytes a read covers
_THREADS = min(4, os.cpu_count() or 1)  # the coordinator's threads for the read assignment


@dataclass(frozen=True, slots=True)
class ReadPart:
    """One rank's part of a load's reads. ``batches``: the batches of shards other ranks need
    too that it reads (for itself and others) or receives, or None when nothing is forwarded;
    ``apart``: shards others need too, in disjoint rows, that it reads its own rows of;
    ``shared``: shards others read too, through the shared page cache. Every other shard it
    needs, no other rank needs: it reads those itself (``own_keys``)."""

    batches: tuple[ReadBatch, ...] | None
    apart: frozenset[ShardKey] = frozenset()
    shared: frozenset[ShardKey] = frozenset()


def own_keys(rank: int, mine: Iterable[ShardKey], part: ReadPart) -> list[ShardKey]:
    """The shards of ``mine`` that ``part`` leaves to this rank alone (no batch of the
    coordinator holds them, no other rank reads them in disjoint rows), in ``mine``'s order: it
    reads them itself, for itself, so they need no batches (nothing is forwarded)."""
    batches = part.batches or ()
    if not batches and not part.apart:  # nothing taken: every shard (alone, or no exchange)
        return list(mine)
    taken = {k for b in batches if rank in b.consumers for k in b.keys} | part.apart
    return [k for k in mine if k not in taken]


def exchange_needs(
    coord: Coordinator, md: Metadata, reads: Iterable[ShardRead], dedup: bool | None, page_cache: bool, extents: Extents
) -> ReadPart:
    """Collective (the checkpoint group): this rank's ``ReadPart`` (module docstring) for the
    saved shards it needs, ``reads``."""
    rows = {(r.fqn, r.shard_index): r.rows for r in reads}
    names = list(md.tensors)
    gathered = coord.gather_object((socket.gethostname(), report_needs(md, rows, names)))
    parts: list[object] | None = None
    if coord.rank == 0:
        assert gathered is not None
        try:
            parts = list(read_parts(md, gathered, dedup, page_cache, extents))
        except CheckpointError as e:
            parts = [e] * coord.world_size
        except Exception as e:  # every rank gets the same error, none waits for a part
            parts = [PlanningError(f"rank 0 could not assign the reads of this load: {type(e).__name__}: {e}")]
            parts *= coord.world_size
    wire = coord.scatter_object(parts)
    if isinstance(wire, CheckpointError):
        raise wire
    return decode_part(wire, names, list(rows), coord.rank)


def report_needs(md: Metadata, rows: dict[ShardKey, Rows], names: list[str] | None = None) -> bytes:
    """What a rank sends the coordinator: one ``NEED_DTYPE`` row per saved shard it needs (the
    tensor's number in the metadata's order, the shard, the rows its copies touch), in the order
    of ``rows`` (the order the answer's masks follow)."""
    number = {n: i for i, n in enumerate(names if names is not None else md.tensors)}
    out = np.empty(len(rows), dtype=NEED_DTYPE)
    if rows:
        out["tensor"] = [number[f] for f, _ in rows]
        out["shard"] = [i for _, i in rows]
        lo_hi = np.asarray(list(rows.values()), dtype=np.int64).reshape(-1, 2)
        out["lo"], out["hi"] = lo_hi[:, 0], lo_hi[:, 1]
    return out.tobytes()


Report = tuple[str, bytes]  # host, the rank's needs (report_needs)
# a rank's part as sent: the batches (id, reader, consumers, keys as int32 (tensor, shard)
# pairs, offsets as int64, bytes) or None, then bit masks over the rank's needs: read apart,
# read through the shared page cache
PartWire = tuple[list[tuple[int, int, tuple[int, ...], bytes, bytes, int]] | None, bytes, bytes]


def read_parts(
    md: Metadata,
    gathered: list[Report],
    dedup: bool | None,
    page_cache: bool,
    extents: Extents,
    max_batch_bytes: int = 64 << 20,
) -> list[PartWire]:
    """Every rank's part from every rank's report (the coordinator; ``planning.read_columns``).
    Only shards several ranks need are assigned here; the bytes each rank reads of the shards
    it alone needs count in the balancing, so the readers are those an assignment of every need
    would choose. Runs with numpy's huge-page advice off (``page_advice``), on a few threads
    (numpy's loops release the GIL)."""
    with huge_pages_off(), ThreadPoolExecutor(_THREADS, thread_name_prefix="unickpt-assign") as pool:
        return _read_parts(md, gathered, dedup, page_cache, extents, max_batch_bytes, pool)


def _read_parts(
    md: Metadata,
    gathered: list[Report],
    dedup: bool | None,
    page_cache: bool,
    extents: Extents,
    max_batch_bytes: int,
    pool: Executor,
) -> list[PartWire]:
    world = len(gathered)
    per_rank = []
    for r, (_, blob) in enumerate(gathered):
        if not isinstance(blob, bytes) or len(blob) % NEED_DTYPE.itemsize:
            raise PlanningError(f"rank {r} sent the coordinator a report of its needs that is not whole rows")
        per_rank.append(np.frombuffer(blob, dtype=NEED_DTYPE))
    job = JobNeeds.of(md, per_rank, pool)
    bounds = np.concatenate([[0], np.cumsum([len(n) for n in per_rank])])
    total_keys = job.total_keys

    def masks(mask: np.ndarray) -> list[bytes]:
        return [np.packbits(mask[bounds[r] : bounds[r + 1]]).tobytes() for r in range(world)]

    hosts = {h for h, _ in gathered}
    if dedup is None and len(hosts) == 1 and page_cache:
        # one host reading local files: its page cache already reads each byte from the device
        # once; forwarding pays off across hosts or for remote storage
        count = np.bincount(job.key, minlength=total_keys)[job.key]
        return [(None, b"", m) for m in masks(count > 1)]
    found = classify(md, job, world, extents, pool)
    chunk = getattr(md.checksums, "chunk_size", 0)
    batches, keys, offsets = assign_columns(job, found, extents, chunk, max_batch_bytes)
    pairs = np.empty((len(keys), 2), dtype="<i4")
    pairs[:, 0], pairs[:, 1] = job.tensor[keys], job.shard[keys]
    mine: list[list[tuple[int, int, tuple[int, ...], bytes, bytes, int]]] = [[] for _ in range(world)]
    for b in batches:
        k, o = pairs[b.start : b.end].tobytes(), offsets[b.start : b.end].astype("<i8").tobytes()
        mine[b.reader].append((b.batch_id, b.reader, b.consumers, k, o, b.nbytes))
        for c in b.consumers:
            if c != b.reader:  # a receiver needs the batch, not the names of the others
                mine[c].append((b.batch_id, b.reader, (c,), k, o, b.nbytes))
    return [(m, a, b"") for m, a in zip(mine, masks(found.apart))]


def decode_part(wire: object, names: list[str], keys: list[ShardKey], rank: int) -> ReadPart:
    """A rank's ``ReadPart`` from what the coordinator sent it (``read_parts``); ``keys``: the
    shards it reported, in its report's order."""
    try:
        if not isinstance(wire, tuple) or len(wire) != 3:
            raise TypeError(f"a {type(wire).__name__}, not a part")
        batches_wire, apart_bits, shared_bits = wire
        apart = np.unpackbits(np.frombuffer(apart_bits, dtype=np.uint8), count=len(keys)) if apart_bits else None
        shared = np.unpackbits(np.frombuffer(shared_bits, dtype=np.uint8), count=len(keys)) if shared_bits else None
        batches = None
        if batches_wire is not None:
            batches = []
            for batch_id, reader, consumers, k, o, nbytes in batches_wire:
                pairs = np.frombuffer(k, dtype="<i4").reshape(-1, 2).tolist()
                batch_keys = tuple((names[t], i) for t, i in pairs)
                offs = tuple(np.frombuffer(o, dtype="<i8").tolist())
                batches.append(ReadBatch(batch_id, reader, tuple(consumers), batch_keys, offs, nbytes))
    except (TypeError, ValueError, IndexError) as e:
        raise PlanningError(f"rank {rank} received no usable part of the load's reads ({type(e).__name__}: {e})") from e

    def chosen(bits: np.ndarray | None) -> frozenset[ShardKey]:
        return frozenset() if bits is None else frozenset(k for k, on in zip(keys, bits.tolist()) if on)

    return ReadPart(None if batches is None else tuple(batches), chosen(apart), chosen(shared))


def vectorized(extent: Extent) -> Extents:
    """``extent`` over arrays, one call per range: for checksums without a vectorised form
    (per-shard checksums of format versions 1 and 2: small jobs)."""

    def each(files: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = [extent(f, a, b) for f, a, b in zip(files.tolist(), lo.tolist(), hi.tolist())]
        both = np.asarray(out, dtype=np.int64).reshape(-1, 2)
        return both[:, 0], both[:, 1]

    return each
