"""The save pipeline: one save on one rank, as stages that return futures.

``Checkpointer.save`` creates a ``SavePipeline`` and calls ``start``; a blocking save is the
same pipeline and then ``handle.wait()``. Stages, in order, on every rank (* = collective):

  groups*    (``__init__``) the foreground and background coordinators; the checkpointer's
             first save or load creates unickpt's process groups here, later ones reuse them. Its
             time is the ``save.groups`` event, emitted by ``start`` right after ``save.begin``
             (both, and ``save.end``, start where this stage started);

  describe*  (caller's thread, foreground group) the state's layout (``state.layout``: every key
             and the kind of its value, checked before anything is written), the adapter's save
             view of its model and optimizer, and the other items' encoded blobs; the one
             all_gather also checks that every rank passes the same path, framework and role and
             the same replicated state, and reports the unseen failures of async saves that
             finished on every rank;
  plan*      (foreground) ``plan_cache.plan_stage``: the cached global plan, or a new one;
  stage      (caller) the snapshot: a blocking save binds the live tensors (zero copy); an async
             save copies buffers and blobs into the staging pool now, and the optimizer's
             parameters and state on the snapshot thread, which that optimizer's next step()
             waits for (``SnapshotGuard``): the snapshot's future (``Snapshot.copied``);
  lock*      (worker thread, background group) ``lock.run_locked`` takes the save lock;
  write      (worker) ``write.write_stage``: data files with their checksums (writer threads;
             ``SaveOptions(writer="process")``: an async save's shared images are written by the
             checkpointer's writer process instead, ``writer_process``);
  commit*    (worker, background) ``commit.commit_stage``: metadata published by rank 0.
``start`` returns a ``SaveHandle`` whose future is the commit's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from ...coordination import Coordinator, Settle, run_stage
from ...errors import RankDisagreementError
from ...folder.lock import SaveLock, run_locked
from ...folder.target import claims
from ...format.build import FileSums, SaveSource
from ...format.names import check_save_names
from ...format.records import Metadata
from ...frameworks import FrameworkAdapter, SaveView, get_framework, supports_step_hooks
from ...monitoring.phases import PhaseRecorder, RecordingBus
from ...options import SaveOptions
from ...planning.save.model import LocalSavePlan, RankSavePlan, data_path
from ...planning.specs import BlobSpec, SaveItem
from ...state.layout import StateLayout, replicated_disagreement
from ...storage import Buffer, Storage
from ...storage.local import LocalStorage
from ...storage.retry import unwrap
from ..gc_pause import GCHold
from ..plan_cache import CachedPlan, PlanKey, plan_stage
from ..runtime.resources import Resources
from ..runtime.worker import SaveHandle
from .commit import commit_stage
from .staging import StagedFiles, live_parts, on_device
from .step_guard import protected_storages, storage_key
from .write import write_stage
from .writer_process import supported as process_writer_supported

__all__ = ["SavePipeline", "Described", "Snapshot"]


@dataclass(frozen=True, slots=True)
class Described:
    """The describe stage's result: the state's layout, the adapter, its view of the state, the
    encoded blobs and the claims every rank must share."""

    layout: StateLayout
    adapter: FrameworkAdapter
    view: SaveView
    blobs: dict[str, bytes]
    claims: dict[str, str]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The staging step's result: each data file's parts and each plan entry's bytes (views of
    live tensors for a blocking save; of the staging images for an async one)."""

    file_parts: dict[str, list[Buffer]]
    entry_bytes: list[Buffer]
    staged: StagedFiles | None
    copied: Future[None] | None  # the background part of the copy (None: the copy is complete)


class SavePipeline:
    """One save of ``state`` to ``storage`` on this rank (see the module docstring).

    ``owner``/``what``: whose unseen async failures the describe stage reports first (a
    ``CheckpointManager`` passes itself and `` of <root>``)."""

    def __init__(
        self,
        res: Resources,
        storage: Storage,
        state: MutableMapping[str, Any],
        *,
        framework: str,
        role: str | None,
        options: SaveOptions,
        owner: object = None,
        what: str = "",
    ) -> None:
        self.res, self.storage, self.state = res, storage, state
        self.framework, self.role, self.options = framework, role, options
        self.owner, self.what = owner, what
        # this save's phase records, kept in the checkpoint (monitoring.phases)
        self.phases = PhaseRecorder() if options.record_phases else None
        if self.phases is not None:
            self.res = res = replace(res, events=RecordingBus(res.events, self.phases))
        label = f"save of {storage.url}"
        self.t0 = time.perf_counter()  # the save starts here: process groups may be created next
        self.coord: Coordinator = res.coordinator("foreground", options.timeout, label)
        self.background: Coordinator = res.coordinator("background", options.timeout, label)
        self.t_groups = time.perf_counter()  # the "save.groups" phase: self.t0 .. here

    # ------------------------------------------------------------------ stages (caller's thread)

    def describe(self) -> Described:
        """Collective: every rank describes its state; all agree on what they save."""
        coord, worker = self.coord, self.res.worker

        def local() -> Described:
            layout = StateLayout.of(self.state)
            adapter = get_framework(self.framework, layout.framework_state)
            view = adapter.save_view(layout.framework_state)
            view.objects.update(layout.objects())
            with self.res.events.phase("save.serialize", coord.rank, path=self.storage.url) as p:
                encoded = layout.encode(coord.rank)  # the other items' blobs: the safe encoding
                p.nbytes = sum(len(b) for b in encoded.blobs.values())
            view.items.extend(encoded.tensors)  # a Stateful's tensors: saved as checkpoint tensors
            check_save_names(view.items, view.objects, encoded.blobs, self.state.get("extra_state"))
            return Described(layout, adapter, view, encoded.blobs, encoded.claims)

        def agree(d: Described) -> dict[str, object]:
            return {**claims("save", self.storage.url, d.adapter.name, self.role), **d.claims}

        unseen = Settle(lambda: worker.finished(self.owner), lambda n: worker.raise_failures(self.owner, self.what, n))
        try:
            return run_stage(coord, "save (describe state)", local, agree=agree, settle=unseen)
        except RankDisagreementError as e:
            clearer = replicated_disagreement(e)
            if clearer is None:
                raise
            raise clearer from None

    def plan(self, d: Described) -> CachedPlan:
        """Collective: this save's global plan (cached while the layout is unchanged)."""
        local = LocalSavePlan(
            self.coord.rank,
            tuple(i.spec for i in d.view.items),
            tuple(BlobSpec(k, len(v)) for k, v in d.blobs.items()),
        )
        key = PlanKey(self.role, d.adapter.name, self.options.files_per_rank, self.options.checksum_chunk_bytes)
        with self.res.events.phase("save.plan", self.coord.rank, path=self.storage.url):
            cached = plan_stage(
                self.coord,
                local,
                self.options.files_per_rank,
                self.res.plans.get(key),
                self.options.checksum_chunk_bytes,
            )
        self.res.plans.put(key, cached)
        return cached

    def stage(self, d: Described, plan: RankSavePlan, async_save: bool) -> Snapshot:
        """The snapshot (collective for async saves: every rank learns all staged)."""
        if not async_save and not on_device(d.view.items, plan):  # views of the live tensors, written in place
            with self.res.events.phase("save.stage", self.coord.rank, path=self.storage.url, save_id=plan.save_id):
                parts, in_order = live_parts(d.view.items, plan, d.blobs)
            return Snapshot(parts, in_order, None, None)
        if not async_save:  # device tensors: one side-stream copy into the reused pinned images
            with self.res.events.phase("save.stage", self.coord.rank, path=self.storage.url, save_id=plan.save_id) as p:
                staged = self.res.staging.stage(d.view.items, plan, d.blobs)
                p.nbytes = staged.nbytes
            return self._snapshot(plan, staged, None)
        later = self._copied_later(d.layout.optimizer)
        mine: list[StagedFiles] = []  # this rank's images, whatever the other ranks did

        def local() -> StagedFiles:
            mine.append(self.res.staging.stage(d.view.items, plan, d.blobs, later, shared=shared))
            return mine[0]

        with self.res.events.phase("save.stage", self.coord.rank, path=self.storage.url, save_id=plan.save_id) as p:
            shared = self._process_writer()
            try:
                staged = run_stage(self.coord, "save (stage)", local)
            except BaseException:  # staged here, failed on another rank: the slot goes back (once
                for s in mine:  # its copy ends), else two such failures leave no slot to stage into
                    s.release()
                raise
            p.nbytes = staged.nbytes
        copied = staged.copied
        if copied is not None:
            self.res.guard.guard(d.layout.optimizer, copied)
        return self._snapshot(plan, staged, copied)

    def _process_writer(self) -> bool:
        """Whether this async save's files go to the writer process: asked for, on a host that
        has it, to plain local files (``type(...) is LocalStorage``: not a subclass with other
        file modes, not another backend)."""
        return (
            self.options.writer == "process"
            and process_writer_supported()
            and type(unwrap(self.storage)) is LocalStorage
        )

    @staticmethod
    def _snapshot(plan: RankSavePlan, staged: StagedFiles, copied: Future[None] | None) -> Snapshot:
        images = {f: memoryview(parts[0]) if parts else memoryview(b"") for f, parts in staged.parts.items()}
        entries: list[Buffer] = [images[e.file][e.byte_offset : e.byte_offset + e.byte_length] for e in plan.entries]
        return Snapshot(staged.parts, entries, staged, copied)

    def _copied_later(self, optimizer: object) -> Callable[[SaveItem], bool] | None:
        """Which save items an async save may copy after returning: those only optimizer.step()
        changes (it waits for the copy; see engine.save.step_guard). None: copy everything now."""
        if not self.options.background_snapshot or not supports_step_hooks(optimizer):
            return None
        protected = protected_storages(optimizer)
        return lambda item: storage_key(item.tensor) in protected

    # ------------------------------------------------------------------ stages (worker thread)

    def write_and_commit(self, lock: SaveLock, d: Described, cached: CachedPlan, snap: Snapshot) -> Metadata | None:
        """Write this rank's files, then the collective commit (rank 0 returns the metadata)."""
        plan = cached.mine
        gplan = cached.global_plan() if self.coord.rank == 0 else None  # the commit's, rank 0 only
        rank, url, events = self.coord.rank, self.storage.url, self.res.events
        nbytes = plan.nbytes  # a sum over the entries: once
        sums, error = None, None
        try:
            if snap.staged is not None:
                snap.staged.wait_ready()
            with events.phase("save.write", rank, path=url, save_id=plan.save_id) as p:
                chunk = cached.chunk
                if snap.staged is not None and snap.staged.shared is not None:
                    files = self._write_in_process(plan, snap.staged, chunk)
                else:
                    files = write_stage(
                        self.storage, plan, snap.entry_bytes, snap.file_parts, self.options.io_threads, events, chunk
                    )
                sums = (chunk, files)
                p.nbytes = nbytes
        except Exception as e:  # reported to all ranks by commit_stage
            error = e
        finally:
            if snap.staged is not None:
                snap.staged.release()
        md = commit_stage(
            self.background,
            self.storage,
            plan.save_id,
            gplan,
            sums,
            error,
            SaveSource(d.adapter.name, self.role, d.view.mesh),
            d.view.objects,  # every rank's: merged per parameter at commit (pipeline stages differ)
            self.options.cleanup_previous,
            events,
            still_locked=lock.verify_holder,
            phases=self.phases,
        )
        events.emit("save.end", rank, self.t0, path=url, save_id=plan.save_id, nbytes=nbytes)
        return md

    def _write_in_process(self, plan: RankSavePlan, staged: StagedFiles, chunk: int) -> FileSums:
        """The write stage by the writer process: each file straight from its shared image."""
        local = unwrap(self.storage)
        assert isinstance(local, LocalStorage) and staged.shared is not None
        files = [
            (f, data_path(plan.save_id, f), memoryview(parts[0]).nbytes if parts else 0, staged.shared.get(f))
            for f, parts in staged.parts.items()
        ]
        return self.res.staging.writer.write(local.root, local.direct_io, files, chunk, self.options.io_threads)

    # ------------------------------------------------------------------ the whole save

    def start(self, async_save: bool) -> SaveHandle:
        """Run describe, plan and stage here; submit lock + write + commit to the worker (after
        any earlier save of this checkpointer). Returns the save's handle (not yet tracked)."""
        rank, url = self.coord.rank, self.storage.url
        self.res.events.emit("save.begin", rank, self.t0, end=self.t0, path=url)
        self.res.events.emit("save.groups", rank, self.t0, end=self.t_groups, path=url)
        # a few records per tensor: no full collections over the job's heap (engine.gc_pause);
        # a blocking save keeps the collector paused until its commit ends (the caller waits),
        # an async save resumes it before handing its write and commit to the worker
        hold = GCHold(self.options.pause_gc)
        release = None
        try:
            d = self.describe()
            cached = self.plan(d)
            plan = cached.mine
            snap = self.stage(d, plan, async_save)
            release = snap.staged.release if snap.staged is not None else None
            if async_save:
                hold.release()
            future = self.res.worker.submit(
                lambda: run_locked(
                    self.background,
                    self.storage,
                    plan,
                    lambda lock: self.write_and_commit(lock, d, cached, snap),
                    on_refused=release,
                    lease_s=self.options.lock_lease_s,
                    ctx=self.res.locks,
                )
            )
        except BaseException:
            hold.release()
            if release is not None:  # staged, but never handed to the worker (e.g. a closed checkpointer)
                release()
            raise
        if not async_save:
            future.add_done_callback(hold.release)
        return SaveHandle(future, snap.copied, self.storage.url)
