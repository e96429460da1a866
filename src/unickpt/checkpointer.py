"""``Checkpointer``: the object that owns what lives across save and load calls.

    ckpt = unickpt.Checkpointer()                    # or Checkpointer(group=pg, save_options=...)
    handle = ckpt.save("ckpts/step_100", state, async_save=True)
    ckpt.load("ckpts/step_100", state)
    ckpt.close()                                     # drains its saves, frees its memory

``unickpt.save`` / ``load`` / ``wait_all`` use a default instance (``default_checkpointer()``);
a job may create its own, e.g. one per role (actor and critic) with its own options and process
group: their async saves never wait on each other (own worker, own staging pool, own snapshot
guard: one optimizer's step waits only for its own snapshot).

What a checkpointer owns (``Resources``, lent to every pipeline it runs):
  plans    ``PlanCache``       global save plans per layout (engine.plan_cache)
  staging  ``StagingPool``     reusable file images of async snapshots + the snapshot thread
  guard    ``SnapshotGuard``   optimizer step pre-hooks waiting for its background copies
  worker   ``SaveWorker``      the background thread (write + commit in submission order), the
                               failure reports of async saves, the drain at interpreter exit
  groups   ``CheckpointGroups`` its gloo groups beside the job's group, created at first use
  locks    ``LockContext``     tokens of the save locks its saves hold
  events   ``EventBus``        listeners of its per-phase events
Order of use: ``save`` -> ``SavePipeline(resources, ...).start(async_save)`` -> handle
(``wait()``ed here for a blocking save); ``load`` -> ``LoadPipeline(resources, ...).run()``.
Collectives: every rank creates its checkpointers in the same order and calls them in the same
order (each has its own process groups, created by its first save or load on every rank).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch.distributed as dist

from .coordination.topology import CoordinationOptions
from .coordination.torch_dist import CheckpointGroups
from .engine.export.hf import HFExportResult
from .engine.export.stage import HFExportStage, run_export
from .engine.load.pipeline import LoadPipeline
from .engine.load.schedule import ReaderThreads
from .engine.plan_cache import PlanCache
from .engine.runtime.interrupts import SaveInterrupts, wait_through
from .engine.runtime.resources import Resources
from .engine.runtime.worker import ANY_OWNER, SaveHandle, SaveWorker
from .engine.save.pipeline import SavePipeline
from .engine.save.staging import StagingPool
from .engine.save.step_guard import SnapshotGuard
from .errors import ConfigurationError
from .folder.lock_owner import LockContext, LockTokens
from .folder.target import open_target
from .format.hf_layout import HFExport
from .format.records import Metadata
from .monitoring.events import EventBus, Listener
from .options import LoadOptions, SaveOptions
from .storage import Storage
from .storage.retry import RetryingStorage

__all__ = ["Checkpointer", "default_checkpointer", "live_checkpointers"]

_LIVE: weakref.WeakSet[Checkpointer] = weakref.WeakSet()  # open checkpointers of this process
_DEFAULT: list[Checkpointer] = []  # the instance unickpt.save/load use, created on first use
_DEFAULT_LOCK = threading.Lock()


def live_checkpointers() -> list[Checkpointer]:
    """Every checkpointer of this process that is not closed."""
    return [c for c in list(_LIVE) if not c.closed]


def _lock_held_here(token: str) -> bool:
    """Whether any live checkpointer of this process holds the save lock with ``token``."""
    return any(c._tokens.holds(token) for c in list(_LIVE))


class Checkpointer:
    """Saves and loads checkpoints; owns the state that lives across calls (module docstring).

    ``group``: the process group whose ranks save and load together (default: the world);
    ``save_options`` / ``load_options``: defaults for calls that pass none; ``listeners``:
    receivers of its per-phase events (``events.add_listener`` adds more); ``coordination``:
    from which world size and how its collectives run as a tree (default: the environment's
    ``UNICKPT_TREE_*`` / ``UNICKPT_RANKS_PER_HOST``, else a tree from 512 ranks, fan-out 16)."""

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None = None,
        save_options: SaveOptions | None = None,
        load_options: LoadOptions | None = None,
        listeners: Iterable[Listener] = (),
        coordination: CoordinationOptions | None = None,
    ) -> None:
        self.save_options = save_options or SaveOptions()
        self.load_options = load_options or LoadOptions()
        self.events = EventBus(listeners)
        self._tokens = LockTokens()
        self.resources = Resources(
            groups=CheckpointGroups(coordination),
            group=group,
            plans=PlanCache(),
            staging=StagingPool(),
            guard=SnapshotGuard(),
            worker=SaveWorker(),
            locks=LockContext(self._tokens, _lock_held_here),
            events=self.events,
            readers=ReaderThreads(),
        )
        self.closed = False
        _LIVE.add(self)

    # ------------------------------------------------------------------ save / load

    def save(
        self,
        path: str,
        state: MutableMapping[str, Any],
        *,
        framework: str = "auto",
        async_save: bool = False,
        role: str | None = None,
        options: SaveOptions | None = None,
    ) -> SaveHandle:
        """Save ``state`` (model, optimizer, extra_state, dataloader) to ``path`` from every rank.

        Blocking: returns once committed. ``async_save=True``: returns once the snapshot is taken;
        writing and the commit run on this checkpointer's worker, after its earlier saves; a
        failure nobody waited for is raised by its next save/load or ``wait()``, or reported at
        exit (the process then exits non-zero). Every rank must pass the same path, framework
        and role. ``options.hf_export``: after the commit, the model is exported into the
        checkpoint's ``huggingface/`` folder (``engine.export.stage``), replacing the export of
        the checkpoint it replaces; a file there unickpt did not write refuses the save before it
        starts (``HFExportStage.check``); the call (async too) returns once that export is
        durable. Ctrl-C (SIGINT) during the call is deferred until the save committed or failed
        on every rank (an async one: until it is handed to the worker), then ``KeyboardInterrupt``
        is raised (``engine.runtime.interrupts``)."""
        return self._save(path, state, None, framework, async_save, role, options, None, "")

    def _submit_after(
        self,
        path: str,
        state: MutableMapping[str, Any],
        then: Callable[[SaveHandle], Metadata | None],
        *,
        framework: str = "auto",
        async_save: bool = False,
        role: str | None = None,
        options: SaveOptions | None = None,
        owner: object,
        what: str = "",
    ) -> SaveHandle:
        """A save followed, on the worker right after it, by ``then(save_handle)`` (which waits
        on it: it runs after the save finished). The returned handle is ``then``'s; its failure
        is reported as ``owner``'s (``wait(owner)``), as are the unseen failures this save
        raises first. ``CheckpointManager`` uses it to move its ``latest`` pointer."""
        return self._save(path, state, then, framework, async_save, role, options, owner, what)

    def _save(
        self,
        path: str,
        state: MutableMapping[str, Any],
        then: Callable[[SaveHandle], Metadata | None] | None,
        framework: str,
        async_save: bool,
        role: str | None,
        options: SaveOptions | None,
        owner: object,
        what: str,
    ) -> SaveHandle:
        """``save`` and ``_submit_after``: the save, ``then`` on the worker after it (when given),
        and the Hugging Face export around it (``SaveOptions.hf_export``: checked before, written
        after the commit; an async save with an export waits for its commit)."""
        opts = options or self.save_options
        export = None
        if opts.hf_export is not None:
            export = HFExportStage(self.resources, path, role, state, opts.hf_export, framework, opts)
        this = _save_what(path, role)
        with SaveInterrupts(this, async_save and export is None):
            if export is not None:
                export.check()
            handle = self._start_save(path, state, framework, async_save, role, options, owner, what)
            if then is not None:
                inner = handle
                # the outer handle's wait_snapshot() is the inner save's: callers change tensors after it
                handle = SaveHandle(
                    self.resources.worker.submit(lambda: then(inner)), snapshot=inner._snapshot, path=path
                )
            md = None
            if not async_save or export is not None:
                md = wait_through(handle, this)
            else:
                self.resources.worker.track(handle, owner)
            if export is not None:
                export.after_commit(md)
        return handle

    def _start_save(
        self,
        path: str,
        state: MutableMapping[str, Any],
        framework: str,
        async_save: bool,
        role: str | None,
        options: SaveOptions | None,
        owner: object,
        what: str,
    ) -> SaveHandle:
        self._check_open()
        options = options or self.save_options
        pipeline = SavePipeline(
            self.resources,
            self._watched(open_target(path, role, options.storage)),
            state,
            framework=framework,
            role=role,
            options=options,
            owner=owner,
            what=what,
        )
        return pipeline.start(async_save)

    def load(
        self,
        path: str,
        state: MutableMapping[str, Any],
        *,
        framework: str = "auto",
        strict: bool = True,
        role: str | None = None,
        options: LoadOptions | None = None,
        source: Callable[[Storage], Storage] | None = None,
    ) -> None:
        """Load the checkpoint at ``path`` into ``state`` in place, resharding as needed.

        Everything is validated on every rank before anything in ``state`` changes
        (``engine.load.pipeline``); the optimizer's state becomes exactly the checkpoint's (a
        rollback: state the checkpoint does not have is removed, gradients are untouched).
        Waits first for this checkpointer's saves in flight (one may target ``path``).
        ``source`` (the RAM tier's recovery, ``recovery.feed``): wraps the storage opened at
        ``path``; the load reads through what it returns."""
        self._check_open()
        worker = self.resources.worker
        worker.drain()
        worker.raise_failures()
        options = options or self.load_options
        storage = self._watched(open_target(path, role, options.storage))
        if source is not None:
            storage = source(storage)
        pipeline = LoadPipeline(
            self.resources,
            storage,
            state,
            framework=framework,
            strict=strict,
            role=role,
            options=options,
        )
        missing, unexpected = pipeline.run()
        if (missing or unexpected) and pipeline.coord.rank == 0:
            warnings.warn(
                f"non-strict load of {storage.url}: skipped {len(missing)} live key(s) missing from the "
                f"checkpoint {missing[:10]} and {len(unexpected)} checkpoint key(s) the state lacks "
                f"{unexpected[:10]}",
                stacklevel=2,
            )

    def export_hf(
        self,
        out: str,
        state: MutableMapping[str, Any],
        options: HFExport | None = None,
        *,
        framework: str = "auto",
        timeout: float | None = None,
    ) -> HFExportResult:
        """Write the model of ``state`` as a Hugging Face safetensors folder ``out`` (new or
        empty), every rank its own share of each file (``engine.export.hf``); collective, on
        every rank. The files equal ``unickpt merge --model-only`` of a checkpoint of ``state``."""
        self._check_open()
        return run_export(self.resources, out, state, options or HFExport(), framework, timeout)

    def _watched(self, storage: Storage) -> Storage:
        """``storage`` reporting each retried transient failure as a ``storage.retry`` event
        (detail: operation, attempt, cause)."""
        if isinstance(storage, RetryingStorage):
            events, rank = self.events, self.rank()

            def on_retry(op: str, target: str, attempt: int, error: BaseException, pause: float) -> None:
                events.emit(
                    "storage.retry", rank, path=target,
                    detail=f"{op} attempt {attempt} failed ({type(error).__name__}: {error}); retry in {pause:.3f} s",
                )  # fmt: skip

            storage.on_retry = on_retry
        return storage

    # ------------------------------------------------------------------ lifetime

    def rank(self) -> int:
        """This process's rank in the checkpointer's group (0 without torch.distributed)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.resources.group)
        return 0

    def wait(self, owner: object = ANY_OWNER) -> None:
        """Block until every save of this checkpointer committed or failed; raise one
        ``AsyncSaveFailures`` naming every failure nobody has seen yet (``owner``: only those
        reported as its, e.g. one ``CheckpointManager``'s)."""
        worker = self.resources.worker
        worker.drain()
        worker.raise_failures(owner)

    def close(self) -> None:
        """Drain this checkpointer's saves, stop its threads and free its staging memory. Raises
        the failures nobody has seen (after closing). Idempotent."""
        if self.closed:
            return
        self.closed = True
        worker = self.resources.worker
        worker.close()
        self.resources.guard.wait()
        self.resources.staging.close()
        self.resources.readers.close()
        self.resources.plans.clear()
        worker.raise_failures(ANY_OWNER)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ConfigurationError("this Checkpointer is closed: create a new one")


def _save_what(path: str, role: str | None) -> str:
    """A save as its interrupt messages name it (``engine.runtime.interrupts``)."""
    return f"save of {path}" + (f" (role {role})" if role else "")


def default_checkpointer() -> Checkpointer:
    """The checkpointer ``unickpt.save`` / ``load`` / ``wait_all`` and ``CheckpointManager`` use
    (created at first use; a closed one is replaced by a new one)."""
    with _DEFAULT_LOCK:
        if not _DEFAULT or _DEFAULT[0].closed:
            _DEFAULT[:] = [Checkpointer()]
        return _DEFAULT[0]
