"""The write stage of a save: one rank's data files, written in parallel with their checksums.

Runs on the checkpointer's worker thread (async saves) or the caller's
thread (blocking saves), after the plan and stage stages, inside the save lock; its checksums (a
CRC32C per ``chunk_size`` chunk of each file, ``format.checksums``) and file sizes go to the
commit stage (``engine.save.commit``), which puts every rank's into the metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from ...errors import InternalError
from ...format.build import FileSums
from ...format.checksums import chunk_crcs
from ...monitoring.events import EventBus
from ...planning.save.model import RankSavePlan, data_path
from ...storage.base import Buffer, Storage

__all__ = ["write_stage"]


def write_stage(
    storage: Storage,
    plan: RankSavePlan,
    entry_bytes: Sequence[Buffer],
    file_parts: dict[str, list[Buffer]],
    threads: int,
    events: EventBus,
    chunk_size: int,
) -> FileSums:
    """Write this rank's files (each plan file name under this save's data folder,
    ``data_path``) in parallel, checksumming each file's chunks alongside."""
    sizes: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for i, e in enumerate(plan.entries):
        if len(entry_bytes[i]) != e.byte_length:
            path = data_path(plan.save_id, e.file)
            raise InternalError(f"{path}: entry {i} has {len(entry_bytes[i])} bytes, plan says {e.byte_length}")
        sizes[e.file] = max(sizes.get(e.file, 0), e.byte_offset + e.byte_length)
        nbytes[e.file] = nbytes.get(e.file, 0) + e.byte_length
    sums: FileSums = {}

    def checksum(name: str) -> None:
        parts = file_parts.get(name, [])
        size = sum(memoryview(p).nbytes for p in parts)
        if size != sizes[name]:
            raise InternalError(
                f"{data_path(plan.save_id, name)}: the staged parts hold {size} bytes, "
                f"the plan's entries end at {sizes[name]}"
            )
        sums[name] = (size, chunk_crcs(parts, chunk_size))

    def write(name: str) -> None:
        path = data_path(plan.save_id, name)
        with events.phase("save.write.file", plan.rank, path=path, save_id=plan.save_id) as p:
            storage.write(path, file_parts.get(name, []))
            p.nbytes = nbytes[name]

    jobs = [(fn, n) for n in sizes for fn in (write, checksum)]
    with ThreadPoolExecutor(max(1, min(threads, len(jobs))), thread_name_prefix="unickpt-write") as pool:
        for f in [pool.submit(fn, n) for fn, n in jobs]:
            f.result()
    return sums
