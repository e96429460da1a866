"""The durable copy of a RAM-committed step, made from the RAM copies by every host in parallel.

``copy_to_durable`` runs on the tier's worker thread of every rank (``tier.RamTier._replicate``,
right after ``replicate.replicate_step`` committed step N in RAM, when N is a multiple of
``durable_every``), before the RAM retention of that round, so a step that is due on the
durable tier is never dropped from RAM before its durable copy is committed:

1. rank 0 checks that the durable folder holds no committed checkpoint and writes the save's
   marker (``folder.markers.mark_save``); the ranks learn its outcome (a gather);
2. each host's agent copies the data files its host originated (its *primaries*, as its commit
   marker names them) from its RAM to the durable tier, one file in memory at a time, each chunk
   checked against the CRC32C recorded at replication before it is written and again when read
   back from the durable tier;
3. a gather of every host's outcome; only when every file was written and verified does rank 0
   publish the metadata (written last, as in ``tiering.copy_checkpoint``), move the durable
   ``latest`` and apply the durable retention. A failure leaves no metadata: the durable step is
   not committed, and the RAM tier keeps that step (``RamTier`` protects it) until a newer
   durable copy commits.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError, IntegrityError
from ..folder.markers import mark_save
from ..folder.probe import read_committed
from ..folder.publish import publisher_for
from ..format.records import METADATA_FILE
from ..storage import open_storage
from .group import TierGroup
from .inventory import RamLayout, crc

__all__ = ["copy_to_durable"]


def copy_to_durable(tg: TierGroup, layout: RamLayout, stepdir: str, step: int, durable: Any) -> None:
    """Steps 1-3 of the module docstring (every rank; ``durable``: the durable
    ``CheckpointManager``)."""
    dst = open_storage(durable.path_for(step))
    rec = layout.markers().get(stepdir) if tg.is_agent else None
    error = ""
    if tg.rank == 0:
        try:
            if read_committed(dst) is not None:
                raise CheckpointError(f"{dst.url} holds a checkpoint already; tiering never overwrites one")
            assert rec is not None
            mark_save(dst, rec["save_id"])
        except (CheckpointError, OSError) as e:
            error = f"{type(e).__name__}: {e}"
    first = tg.all_gather(error)[0]
    if first:
        raise CheckpointError(f"step {step} was not copied to the durable tier: rank 0: {first}")
    try:
        if rec is not None:
            for entry in rec["files"]:
                if entry["where"] == "primary" and entry["origin"] == tg.host and entry["name"] != METADATA_FILE:
                    _copy_file(layout.primary(stepdir, entry["name"]), dst, entry, int(rec["chunk"]))
    except (CheckpointError, OSError) as e:
        error = f"{type(e).__name__}: {e}"
    failed = [f"rank {r}: {m}" for r, m in enumerate(tg.all_gather(error)) if m]
    if failed:
        raise IntegrityError(f"step {step}'s durable copy at {dst.url} is not committed: {'; '.join(failed[:3])}")
    if tg.rank == 0:
        with open(layout.primary(stepdir, METADATA_FILE), "rb") as fh:
            raw = fh.read()
        assert rec is not None
        meta = next(e for e in rec["files"] if e["name"] == METADATA_FILE)
        if (
            len(raw) != meta["size"]
            or [crc(raw[i : i + rec["chunk"]]) for i in range(0, len(raw), rec["chunk"])] != meta["crcs"]
        ):
            raise IntegrityError(
                f"{layout.primary(stepdir, METADATA_FILE)} changed since step {step} was committed in RAM"
            )
        publisher_for(dst).publish(METADATA_FILE, raw)
        durable._publish_latest(step, rec["save_id"])
        durable.apply_retention()


def _copy_file(path: str, dst: Any, entry: dict[str, Any], chunk: int) -> None:
    size, crcs, name = int(entry["size"]), entry["crcs"], entry["name"]
    buf = bytearray(size)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        got = os.preadv(fd, [view], 0)
    finally:
        os.close(fd)
    bad = [
        i
        for i, at in enumerate(range(0, size, chunk))
        if got < min(size, at + chunk) or crc(view[at : at + chunk]) != crcs[i]
    ]
    if bad:
        raise IntegrityError(f"{path}: chunk(s) {bad[:5]} no longer match their CRC32C; not copied to {dst.url}")
    dst.write(name, [view])
    for i, at in enumerate(range(0, size, chunk)):  # read back from the durable tier
        piece = view[at : min(size, at + chunk)]
        dst.read_into(name, at, piece)
        if crc(piece) != crcs[i]:
            raise IntegrityError(f"{dst.url}/{name}: chunk {i} read back from the durable tier failed CRC32C")
