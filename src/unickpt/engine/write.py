"""The write stage of a save: one rank's data files, written in parallel with their checksums.

Called by the save pipeline on the checkpointer's worker thread (async saves) or the caller's
thread (blocking saves), after the plan and stage stages, inside the save lock; its checksums go
to the commit stage (``engine.commit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import crc32c

from ..errors import CheckpointError
from ..monitoring.events import EventBus
from ..planning.save_plan import RankSavePlan
from ..storage.base import Buffer, Storage

__all__ = ["write_stage"]


def write_stage(
    storage: Storage,
    plan: RankSavePlan,
    entry_bytes: Sequence[Buffer],
    file_parts: dict[str, list[Buffer]],
    threads: int,
    events: EventBus,
) -> list[int]:
    """Write this rank's files in parallel, checksumming each entry (plan order) alongside."""
    by_file: dict[str, list[int]] = {}
    for i, e in enumerate(plan.entries):
        by_file.setdefault(e.file, []).append(i)
        if len(entry_bytes[i]) != e.byte_length:
            raise CheckpointError(f"{e.file}: entry {i} has {len(entry_bytes[i])} bytes, plan says {e.byte_length}")
    crcs = [0] * len(plan.entries)

    def checksum(name: str) -> None:
        for i in by_file[name]:
            crcs[i] = crc32c.crc32c(entry_bytes[i])

    def write(name: str) -> None:
        with events.phase("save.write.file", plan.rank, path=name, save_id=plan.save_id) as p:
            storage.write(name, file_parts.get(name, []))
            p.nbytes = sum(plan.entries[i].byte_length for i in by_file[name])

    jobs = [(fn, n) for n in by_file for fn in (write, checksum)]
    with ThreadPoolExecutor(max(1, min(threads, len(jobs))), thread_name_prefix="unickpt-write") as pool:
        for f in [pool.submit(fn, n) for fn, n in jobs]:
            f.result()
    return crcs
