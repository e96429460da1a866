"""The durable copy of a RAM-committed step, made from the RAM copies by every host in parallel.

``copy_to_durable`` runs on the tier's worker thread of every rank (``tier.RamTier._replicate``,
right after ``replicate.replicate_step`` committed step N in RAM, when N is a multiple of
``durable_every``), before the RAM retention of that round, so a step that is due on the
durable tier is never dropped from RAM before its durable copy is committed:

1. rank 0 checks that the durable folder holds no committed checkpoint and writes the save's
   marker (``folder.markers.mark_save``); the ranks learn its outcome (a gather);
2. each host's agent copies the data files its host originated (its *primaries*, as its commit
   marker names them), and those of a host that is no longer in the job (a restart on fewer
   hosts, or on hosts of other names) when it is the first (sorted) holding a copy (``_copiers``,
   from every host's marker gathered in 1), from its RAM to the durable tier, one file in memory
   at a time, each chunk checked against the CRC32C recorded at replication before it is
   written and again when read back from the durable tier;
3. a gather of every host's outcome; only when every file was written and verified does rank 0
   publish the metadata (written last, as in ``tiering.copy_checkpoint``), move the durable
   ``latest`` and apply the durable retention. A failure leaves no metadata: the durable step is
   not committed, and the RAM tier keeps that step (``RamTier`` protects it) until a newer
   durable copy commits.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import ConfigurationError, IntegrityError
from ..folder.markers import mark_save
from ..folder.probe import read_committed
from ..folder.publish import publisher_for
from ..format.checksums import chunk_crcs, crc32c
from ..format.records import METADATA_FILE
from ..storage import open_storage
from .folders import as_unsafe_folder
from .group import TierGroup
from .inventory import RamLayout

__all__ = ["copy_to_durable"]


def copy_to_durable(
    tg: TierGroup, layout: RamLayout, stepdir: str, step: int, durable: Any,
    check: Callable[[], str | None] | None = None,
) -> None:  # fmt: skip
    """Steps 1-3 of the module docstring (every rank; ``durable``: the durable
    ``CheckpointManager``; ``check``: what makes this host's folders of the step unsafe,
    ``folders.step_folder_problem``). Each step ends in ``TierGroup.fail_together``: a rank whose
    part fails (an unsafe folder, a commit marker gone, a file that no longer matches its CRC32C,
    the durable tier's own errors) never raises alone, every rank raises the same error."""
    dst: Any = None
    rec = None
    error: Exception | None = None
    try:
        dst = open_storage(durable.path_for(step))
        if tg.is_agent:
            problem = check() if check is not None else None
            if problem is not None:
                raise ConfigurationError(problem)
            rec = layout.markers().get(stepdir)
            if rec is None:
                raise IntegrityError(f"{layout.marker(stepdir)} is gone: step {step} is no longer committed in RAM")
        if tg.rank == 0:
            assert rec is not None
            if read_committed(dst) is not None:
                raise ConfigurationError(
                    f"{dst.url} holds a checkpoint already; tiering never overwrites one: move it away or "
                    "point the durable tier elsewhere"
                )
            mark_save(dst, rec["save_id"])
    except Exception as e:
        error = e
    held = {} if rec is None else _held(rec)
    mine = None if rec is None else [rec["required"], held]
    gathered = tg.fail_together(error, f"step {step} was not copied to the durable tier", [tg.host, mine])
    copiers = _copiers(gathered, step)  # IntegrityError on every rank alike: a file no host holds
    url = dst.url
    try:
        if rec is not None:
            for name, entry in sorted(held.items()):
                if copiers.get(name) == tg.host:
                    _copy_file(layout, layout.path_of(entry, stepdir), dst, entry, int(rec["chunk"]))
    except Exception as e:
        error = as_unsafe_folder(e, check)
    tg.fail_together(error, f"step {step}'s durable copy at {url} is not committed")
    try:
        if tg.rank == 0:
            assert rec is not None
            meta = next(e for e in rec["files"] if e["name"] == METADATA_FILE)
            raw = _read_verified(layout, layout.primary(stepdir, METADATA_FILE), meta, int(rec["chunk"]))
            publisher_for(dst).publish(METADATA_FILE, raw)
            durable._publish_latest(step, rec["save_id"])
            durable.apply_retention()
    except Exception as e:
        error = as_unsafe_folder(e, check)
    what = f"the commit of step {step}'s durable copy at {url} failed (its metadata, latest or the durable retention)"
    tg.fail_together(error, what)


def _held(rec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The step's data files a host's marker names: name -> its entry (its primary here before
    a replica)."""
    out: dict[str, dict[str, Any]] = {}
    for entry in sorted(rec["files"], key=lambda e: e["where"] != "primary"):
        if entry["name"] != METADATA_FILE:
            out.setdefault(entry["name"], entry)
    return out


def _copiers(gathered: list[Any], step: int) -> dict[str, str]:
    """Who copies each data file of the step (the same on every rank): the host that wrote it
    when it holds a copy, else the first host (sorted) that holds one: a job restarted on fewer
    hosts (or on hosts of other names) still copies every file, from the copies its hosts hold.
    ``IntegrityError`` for a required file no host holds (nothing was written yet)."""
    holders: dict[str, list[str]] = {}  # name -> hosts holding a copy, sorted
    origins: dict[str, str] = {}
    required: list[str] = []
    for host, held in sorted((h, x) for h, x in gathered if x is not None):
        required = required or [n for n in held[0] if n != METADATA_FILE]
        for name, entry in held[1].items():
            holders.setdefault(name, []).append(host)
            origins[name] = entry["origin"]
    lacking = [n for n in required if n not in holders]
    if lacking:
        raise IntegrityError(
            f"step {step} cannot be copied to the durable tier: no host's RAM holds {', '.join(lacking[:3])}"
            + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
        )
    return {name: origins[name] if origins[name] in hosts else hosts[0] for name, hosts in holders.items()}


def _read_verified(layout: RamLayout, path: str, entry: dict[str, Any], chunk: int) -> bytes:
    """The file at ``path`` (no link followed; at most its recorded size read) when its size and
    every chunk's CRC32C are those recorded at replication (``entry``); else ``IntegrityError``."""
    size = int(entry["size"])
    fd = layout.open_read(path)
    try:
        raw = os.pread(fd, size + 1, 0)
    finally:
        os.close(fd)
    if len(raw) != size or chunk_crcs([raw], chunk) != entry["crcs"]:
        raise IntegrityError(f"{path} changed since it was committed in RAM: not copied to the durable tier")
    return raw


def _copy_file(layout: RamLayout, path: str, dst: Any, entry: dict[str, Any], chunk: int) -> None:
    size, crcs, name = int(entry["size"]), entry["crcs"], entry["name"]
    buf = bytearray(size)
    view = memoryview(buf)
    fd = layout.open_read(path)
    try:
        got = os.preadv(fd, [view], 0)
    finally:
        os.close(fd)
    bad = [
        i
        for i, at in enumerate(range(0, size, chunk))
        if got < min(size, at + chunk) or crc32c(view[at : at + chunk]) != crcs[i]
    ]
    if bad:
        raise IntegrityError(f"{path}: chunk(s) {bad[:5]} no longer match their CRC32C; not copied to {dst.url}")
    dst.write(name, [view])
    for i, at in enumerate(range(0, size, chunk)):  # read back from the durable tier
        piece = view[at : min(size, at + chunk)]
        dst.read_into(name, at, piece)
        if crc32c(piece) != crcs[i]:
            raise IntegrityError(f"{dst.url}/{name}: chunk {i} read back from the durable tier failed CRC32C")
