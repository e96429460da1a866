"""Hot/cold tiering: save to a fast tier, return, copy to a durable tier in the background.

    tiers = unickpt.TieredCheckpointManager("shm://job1", "s3://bucket/job1", keep_fast=2)
    tiers.save(step, state, async_save=True)   # fast tier: the training loop waits for this only
    ...
    tiers.load_latest(state)                   # the newest step of either tier (fast first)
    tiers.wait()                               # copies done (or their failures raised)

Order of use (every rank calls ``save`` / ``load_latest`` / ``wait``):
  ``save``  -> the fast tier's ``CheckpointManager.save`` (snapshot, write, commit, ``latest``);
            rank 0 then queues ``_promote(step)`` on this object's copier thread, which waits
            for that save, copies the committed checkpoint to the durable tier through the
            storage protocol (``copy_checkpoint``: the data marker, every data file, then
            ``verify`` of every chunk's CRC32C *on the durable copy*, and only then the metadata,
            written last), moves the durable ``latest``, applies the durable retention
            (``keep_durable``), and finally the fast retention: a fast copy beyond the newest
            ``keep_fast`` is deleted only when the durable tier holds that same save (same save
            id, verified).
  ``load_latest`` -> rank 0 picks the newer of the two tiers' latest steps (the fast tier on a
            tie), all ranks load it.
With ``replicas=0`` (the default) the fast tier must be visible to every rank that saves
(``shm://`` for one node, a shared fast file system for several); copies run on rank 0 only.

With ``replicas >= 1`` the fast tier is each host's own RAM (``shm://<name>`` resolved on every
host; ``unickpt.recovery``): every rank's ``save`` writes its shards to its host's RAM, then the
tier's worker thread copies each host's files to ``replicas`` other hosts through a gloo group of
the tier's own and commits the step in RAM (``recovery.replicate``); every ``durable_every``-th
committed step is then copied from the RAM copies to the durable tier, each host its own files
(``recovery.durable``).
``load_latest`` makes one decision for the job (``recovery.restore``): the newest step of which
every chunk has a verified copy in some host's RAM, unless the durable tier holds a newer one;
``last_recovery`` says which source fed how many bytes. Options: ``check_finite`` (a step with
NaN/Inf is never promoted nor loaded), ``flush_on_sigterm`` (SIGTERM flushes the newest RAM step
to the durable tier first). Guide: docs/guide/recovery.md.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import warnings
from collections.abc import MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .checkpointer import Checkpointer, default_checkpointer
from .engine.runtime.worker import SaveHandle
from .errors import (
    AsyncSaveFailures,
    CheckpointError,
    ChecksumMismatchError,
    ConfigurationError,
    IntegrityError,
    MissingDataFileError,
)
from .folder.markers import mark_save
from .folder.probe import read_committed
from .folder.publish import publisher_for
from .format.codec import decode_metadata
from .format.records import METADATA_FILE, Metadata
from .manager import CheckpointManager
from .monitoring.phases import MAX_PHASES_BYTES, phases_name
from .options import LoadOptions
from .recovery.finite import nonfinite_names
from .recovery.restore import RecoveryReport, rebuilds
from .recovery.tier import RamStepsManager, RamTier, node_root, tier_group
from .storage import Storage, open_storage

__all__ = ["TieredCheckpointManager", "copy_checkpoint"]

_CHUNK = 16 << 20


def copy_checkpoint(src: Storage, dst: Storage) -> Metadata:
    """Copy the committed checkpoint at ``src`` to the empty location ``dst``: marker, data files,
    the save's phase records if any (``monitoring.phases``; best effort), a CRC32C check of every
    shard and blob read back from ``dst``, then the metadata (last)."""
    from .ops.verify import verify

    raw = read_committed(src)
    if raw is None:
        raise MissingDataFileError(
            f"{src.url}/{METADATA_FILE} is missing: the fast tier holds no committed checkpoint to copy"
        )
    md = decode_metadata(raw, f"{src.url}/{METADATA_FILE}")
    if read_committed(dst) is not None:
        raise ConfigurationError(
            f"{dst.url} holds a checkpoint already; tiering never overwrites one: move it away or point the "
            "durable tier elsewhere"
        )
    mark_save(dst, md.save_id)
    for name in md.files:
        size = src.size(name)
        if size is None:
            raise MissingDataFileError(f"{src.url}/{name} is missing: the fast copy is incomplete")
        buf = bytearray(size)
        view = memoryview(buf)
        for at in range(0, size, _CHUNK):
            src.read_into(name, at, view[at : min(size, at + _CHUNK)])
        dst.write(name, [view])
        del view, buf
    try:
        phases = src.read(phases_name(md.save_id), MAX_PHASES_BYTES)
        if phases is not None:
            dst.write(phases_name(md.save_id), [phases])
    except Exception:  # records are for diagnosis only: a copy without them is complete
        pass
    report = verify(md, dst)
    if not report.ok:
        raise ChecksumMismatchError(f"the durable copy at {dst.url} failed verification: {report.failures[:3]}")
    publisher_for(dst).publish(METADATA_FILE, raw)
    return md


class TieredCheckpointManager:
    """Two ``CheckpointManager``s (fast, durable) and a background copier (module docstring)."""

    def __init__(
        self,
        fast_root: str,
        durable_root: str,
        *,
        replicas: int = 0,
        durable_every: int | None = None,
        keep_fast: int = 2,
        keep_durable: int | None = None,
        role: str | None = None,
        checkpointer: Checkpointer | None = None,
        chunk_bytes: int = _CHUNK,
        timeout: float = 600.0,
        check_finite: bool = False,
        flush_on_sigterm: bool = True,
        flush_budget: float = 60.0,
    ) -> None:
        """``replicas``: other hosts holding a copy of each host's RAM checkpoint (0: today's
        tiering, module docstring); ``durable_every`` (``replicas >= 1`` only; None: every step):
        the steps saved to the durable tier too; ``chunk_bytes``: the unit of replication and of
        its CRC32C checks; ``timeout``: seconds a replication or recovery collective may wait;
        ``check_finite`` (``replicas >= 1`` only): a step whose floating tensors hold NaN/Inf is
        never promoted to the durable tier nor chosen by ``load_latest`` (a warning names them);
        ``flush_on_sigterm`` (``replicas >= 1``, constructed on the main thread): on SIGTERM the
        newest RAM step not yet durable is copied to the durable tier, waiting at most
        ``flush_budget`` seconds, then the signal proceeds (the previous handler, or the default:
        the process ends)."""
        if keep_fast < 1:
            raise ValueError(f"keep_fast must be >= 1, got {keep_fast}")
        if type(replicas) is not int or replicas < 0:
            raise ConfigurationError(f"replicas must be an int >= 0, got {replicas!r}")
        if durable_every is not None and (type(durable_every) is not int or durable_every < 1):
            raise ConfigurationError(f"durable_every must be an int >= 1 or None, got {durable_every!r}")
        if replicas == 0 and durable_every not in (None, 1):
            raise ConfigurationError(
                "durable_every needs replicas >= 1: with replicas=0 every step is copied to the durable tier"
            )
        if check_finite and not replicas:
            raise ConfigurationError("check_finite needs replicas >= 1")
        self.check_finite = check_finite
        if replicas and role is not None:
            raise ConfigurationError("replicas >= 1 does not support a role yet: leave role=None")
        self._ckpt = checkpointer or default_checkpointer()
        self.replicas, self.durable_every = replicas, durable_every
        self.last_recovery: RecoveryReport | None = None
        self._ram: RamTier | None = None
        self._previous_sigterm: Any = None
        self._flush_budget = flush_budget
        tg = None
        if replicas:  # the tier's group first: every rank fails alike on unsafe RAM folders or options
            fast_root = node_root(fast_root)
            options = {"fast": fast_root, "durable": durable_root, "replicas": replicas,
                       "durable_every": durable_every, "keep_fast": keep_fast, "chunk": chunk_bytes,
                       "check_finite": check_finite}  # fmt: skip
            tg = tier_group(fast_root, options, replicas, timeout)
        fast_kind = RamStepsManager if replicas else CheckpointManager
        self.fast = fast_kind(fast_root, keep_last=None, role=role, checkpointer=self._ckpt)
        self.durable = CheckpointManager(durable_root, keep_last=keep_durable, role=role, checkpointer=self._ckpt)
        self.keep_fast = keep_fast
        self.role = role
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="unickpt-tiering")
        self._pending: list[tuple[int, Future[Metadata]]] = []
        self._lock = threading.Lock()
        if tg is not None:
            if flush_on_sigterm and threading.current_thread() is threading.main_thread():
                self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._ram = RamTier(tg, self.fast, self.durable, durable_every or 1, keep_fast, chunk_bytes)

    def _storage(self, manager: CheckpointManager, step: int) -> Storage:
        url = manager.path_for(step) + (f"/{self.role}" if self.role else "")
        return open_storage(url)

    def save(self, step: int, state: MutableMapping[str, Any], **kwargs: Any) -> SaveHandle:
        """Save ``step`` to the fast tier (``CheckpointManager.save`` arguments); rank 0 then
        copies it to the durable tier in the background."""
        nonfinite = nonfinite_names(state) if self.check_finite else None
        handle = self.fast.save(step, state, **kwargs)
        if self._ram is not None:
            self._ram.after_save(step, handle, nonfinite)
            return handle
        if self._ckpt.rank() == 0:
            future = self._copier.submit(self._promote, step, handle)
            with self._lock:
                self._pending.append((step, future))
        return handle

    def _promote(self, step: int, handle: SaveHandle) -> Metadata:
        handle.wait()
        md = copy_checkpoint(self._storage(self.fast, step), self._storage(self.durable, step))
        self.durable._publish_latest(step, md.save_id)
        self.durable.apply_retention()
        self._fast_retention()
        return md

    def _fast_retention(self) -> list[int]:
        """Delete fast copies beyond the newest ``keep_fast`` whose durable copy is this save."""
        complete = [c.step for c in self.fast.list_checkpoints()]
        pointer = self.fast.read_pointer()
        keep = set(complete[-self.keep_fast :]) | ({pointer.step} if pointer is not None else set())
        dropped = []
        for step in complete:
            if step in keep:
                continue
            fast_md, durable_md = self.fast._metadata(step), self.durable._metadata(step)
            if fast_md is None or durable_md is None or durable_md.save_id != fast_md.save_id:
                continue  # not (yet) safe on the durable tier
            self.fast._delete_checkpoint(step, self.fast._scan().get(step, []))
            dropped.append(step)
        return dropped

    def wait(self) -> None:
        """Every save committed on the fast tier and copied to the durable one; raises
        ``AsyncSaveFailures`` naming every failed copy (and the fast tier's own failures)."""
        self.fast.wait()
        if self._ram is not None:
            self._ram.wait()
            self.durable.wait()
        with self._lock:
            pending, self._pending = self._pending, []
        failures = []
        for step, future in pending:
            error = future.exception()
            if error is not None:
                failures.append((self.durable.path_for(step), error))
        if failures:
            raise AsyncSaveFailures(failures, f" to the durable tier {self.durable.root}")

    def latest_step(self) -> tuple[int | None, str]:
        """The newest complete step of either tier and the tier holding it (fast on a tie):
        ``(step, "fast" | "durable")``, ``(None, "")`` when there is none. With ``replicas >= 1``
        a collective (every rank calls it, after its saves) with the same answer on every rank:
        the step ``load_latest`` would load, the newest of which every file has a copy in some
        host's RAM, unless the durable tier holds a newer one (``RamTier.latest``)."""
        if self._ram is not None:
            self.fast.wait()
            step, source = self._ram.latest(self.durable.latest_step)
            return step, {"ram": "fast", "durable": "durable"}.get(source, "")
        fast, durable = self.fast.latest_step(), self.durable.latest_step()
        if fast is None and durable is None:
            return None, ""
        if durable is None or (fast is not None and fast >= durable):
            return fast, "fast"
        return durable, "durable"

    def load_latest(
        self, state: MutableMapping[str, Any], *, framework: str = "auto", strict: bool = True,
        options: LoadOptions | None = None,
    ) -> int | None:  # fmt: skip
        """Load the newest step found in either tier (every rank); None when there is none."""
        if self._ram is not None:
            return self._load_replicated(state, framework, strict, options)
        coord = self._ckpt.resources.coordinator("foreground", None, "tiered load_latest")
        choice: tuple[int | None, str] = self.latest_step() if coord.rank == 0 else (None, "")
        if coord.world_size > 1:
            choice = coord.broadcast_object(choice)
        step, tier = choice
        if step is None:
            return None
        manager = self.fast if tier == "fast" else self.durable
        self._ckpt.load(
            manager.path_for(step), state, framework=framework, strict=strict, role=self.role, options=options
        )
        return step

    def _load_replicated(
        self, state: MutableMapping[str, Any], framework: str, strict: bool, options: LoadOptions | None
    ) -> int | None:
        """``load_latest`` with replicas: the job's one decision (``recovery.restore``), then the
        ordinary load of the chosen step from this host's RAM (or from the durable tier)."""
        assert self._ram is not None
        self.fast.wait()
        # first from each host's own RAM only: a restart whose hosts kept their RAM moves no byte
        # between hosts when every rank's load finds what it reads on its host. When the load
        # checks every chunk's CRC32C (the default), this pass reads no byte before it: a copy
        # here that fails the load's check sends the job to the second pass, which verifies
        # every copy before it uses one
        # A host that lost its RAM does not write its files back before the load: its ranks read
        # them from their holders straight into the state (``recovery.feed``), and the files are
        # written back into its RAM in the background after the load
        verifies = options is None or options.verify_checksums
        decision, report = self._ram.recover(self.durable.latest_step, fetch=False, load_verifies=verifies,
                                             feed=verifies)  # fmt: skip
        tried: int | None = None  # the step whose load began in the first pass
        if report.tier == "ram":
            loaded = False
            feed = self._ram.start_feed(decision)
            try:
                if decision["metadata_everywhere"]:
                    tried = int(decision["step"])
                    try:
                        self._ckpt.load(self.fast.path_for(int(decision["step"])), state, framework=framework,
                                        strict=strict, options=options, source=feed.wrap)  # fmt: skip
                        loaded = True
                    except CheckpointError:
                        pass  # a file this host lacks or a copy that failed: verify, fetch, load again
            finally:
                loaded, fed = self._ram.finish_feed(feed, loaded)
            if loaded:
                report = _with_fed(report, fed)
                self.last_recovery = report
                self._emit(report)
                if rebuilds(decision):
                    self._ram.rebuild_fed(int(decision["step"]), decision)
                return int(decision["step"])
            decision, report = self._ram.recover(self.durable.latest_step, fetch=True)
        self.last_recovery = report
        self._emit(report)
        rank = self._ckpt.rank()
        if report.tier == "none":
            if tried is not None:  # the first load may have written part of that step into the state
                raise IntegrityError(
                    f"no step can be recovered from {self.fast.root} or {self.durable.root} "
                    f"({'; '.join(report.skipped_steps[:3])}), and a load of step {tried} "
                    "had begun: the state may hold part of it; restart from your initial state"
                )
            return None
        if report.tier == "durable" and report.skipped_steps and rank == 0:
            warnings.warn(
                f"no RAM step had a verified copy of every chunk ({'; '.join(report.skipped_steps[:3])}): "
                f"loading step {report.step} from the durable tier {self.durable.root}",
                stacklevel=3,
            )
        manager = self.fast if report.tier == "ram" else self.durable
        step = int(decision["step"])
        self._ckpt.load(manager.path_for(step), state, framework=framework, strict=strict, options=options)
        return step

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM with replicas: flush the newest RAM step to the durable tier (within
        ``flush_budget``), then hand the signal on; a flush that fails or runs out of time is
        reported on stderr and the signal proceeds anyway."""
        import sys

        assert self._ram is not None
        try:
            step = self._ram.flush(self._flush_budget)
            if step is not None:
                print(f"unickpt: SIGTERM: step {step} flushed to {self.durable.root}", file=sys.stderr)
        except Exception as e:  # the job is ending: say so, never stop the signal
            print(f"unickpt: SIGTERM: no flush to {self.durable.root}: {type(e).__name__}: {e}", file=sys.stderr)
        previous = self._previous_sigterm
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def _emit(self, report: RecoveryReport) -> None:
        """The recovery's records: one ``load.transfer`` event per source (bytes, summed over the
        hosts) and one per copy that failed its CRC32C check."""
        rank = self._ckpt.rank()
        for source, n in report.bytes_by_source.items():
            self._ckpt.events.emit("load.transfer", rank, nbytes=n, detail=f"ram recovery: {n} bytes from {source}")
        for failed in report.failed_copies:
            self._ckpt.events.emit("load.transfer", rank, detail=f"ram recovery: failed copy {failed}")

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._copier.shutdown(wait=True)
            if self._ram is not None:
                self._ram.close()
                if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
                    if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                        signal.signal(signal.SIGTERM, self._previous_sigterm)


def _with_fed(report: RecoveryReport, fed: dict[str, int]) -> RecoveryReport:
    """``report`` with the bytes the load read from other hosts' RAM (``recovery.feed``) added."""
    if not fed:
        return report
    by_source = dict(report.bytes_by_source)
    by_source["peer"] = by_source.get("peer", 0) + sum(fed.values())
    by_host = dict(report.peer_bytes_by_host)
    for host, n in fed.items():
        by_host[host] = by_host.get(host, 0) + n
    return dataclasses.replace(
        report, bytes_by_source=by_source, peer_bytes_by_host=by_host, fed_bytes=sum(fed.values())
    )
