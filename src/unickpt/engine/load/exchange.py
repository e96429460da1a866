"""The exchange of a distributed load's needs: gathered at the coordinator, each rank told only
its own part (the collective around ``planning.load.assign.assign_reads``).

Runs inside the read stage (``engine.load.stage``) when reads are deduplicated across ranks (several
ranks, ``LoadOptions.dedup_reads`` not False). Order: every rank sends the coordinator (rank 0;
up the tree when the job's coordinator is a tree) its host name and its needs
(``report_needs``) -> the coordinator assigns the job's reads (``assign_reads``, on a few
threads, numpy's huge-page advice off: ``page_advice``) -> each rank receives only its part and
decodes it (``decode_part``). A failure at the coordinator reaches every rank as the same error.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from ...coordination.base import Coordinator
from ...errors import CheckpointError, PlanningError
from ...format.records import Metadata
from ...planning.load.assign import PartWire, ReadPart, Report, assign_reads, decode_part, report_needs
from ...planning.load.overlap import ShardRead
from ...planning.load.runs import Extents
from .page_advice import huge_pages_off_for

__all__ = ["exchange_needs", "read_parts"]

_THREADS = min(4, os.cpu_count() or 1)  # the coordinator's threads for the read assignment


def exchange_needs(
    coord: Coordinator, md: Metadata, reads: Iterable[ShardRead], dedup: bool | None, page_cache: bool, extents: Extents
) -> ReadPart:
    """Collective (the checkpoint group): this rank's ``ReadPart`` (``planning.load.assign``) for
    the saved shards it needs, ``reads``."""
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


def read_parts(
    md: Metadata,
    gathered: list[Report],
    dedup: bool | None,
    page_cache: bool,
    extents: Extents,
    max_batch_bytes: int = 64 << 20,
) -> list[PartWire]:
    """Every rank's part from every rank's report (the coordinator): ``assign_reads`` on a few
    threads (numpy's loops release the GIL), with numpy's huge-page advice off when the reports
    are large enough for numpy to advise any of its arrays (``page_advice.huge_pages_off_for``)."""
    reported = sum(len(needs) for _, needs in gathered)
    with huge_pages_off_for(reported), ThreadPoolExecutor(_THREADS, thread_name_prefix="unickpt-assign") as pool:
        return assign_reads(md, gathered, dedup, page_cache, extents, max_batch_bytes, pool.map)
