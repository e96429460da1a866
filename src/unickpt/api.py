"""``unickpt.save`` / ``unickpt.load``: build the pipeline (adapter -> planner -> engine -> storage).

Who calls what, in order, on every rank:
  save: wait for the previous save (one in flight) -> adapter.save_view -> plan (collective, cached
        while the sharding is unchanged) -> stage (snapshot; async: buffers in the call, the
        optimizer's parameters and state on the snapshot thread, which its next step() waits
        for) -> [background if async] write -> commit (collective) -> handle done.
  load: wait for any save in flight -> read metadata (collective) -> ``_load.load_once``:
        adapter.load_view + validate everything (keys, shapes, dtypes, param groups; agreed
        across ranks) -> read + copy in place (or into staging) -> apply (optimizer state,
        param groups, extra state) on every rank.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, MutableMapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from ._load import load_once
from .coordination import make_coordinator, run_stage
from .engine import step_guard
from .engine.load import read_metadata
from .engine.lock import SaveLock, checkpoint_replaced, run_locked
from .engine.save import CachedPlan, SaveRequest, commit_stage, plan_stage, write_stage
from .engine.staging import STAGING_POOL, live_parts
from .engine.worker import SAVE_WORKER
from .errors import (
    CheckpointError,
    ChecksumMismatchError,
    FrameworkError,
    MissingDataFileError,
    RankFailures,
    TruncatedDataFileError,
)
from .format.records import Metadata
from .format.values import dumps_value
from .frameworks import get_framework
from .monitoring.events import emit, phase
from .options import LoadOptions, SaveOptions
from .planning.save_plan import LocalSavePlan, RankSavePlan
from .planning.specs import BlobSpec, SaveItem
from .state.extra import extra_blob_key
from .storage import Buffer, Storage, open_storage

__all__ = ["save", "load", "SaveHandle"]

_LOAD_ATTEMPTS = 3
_KNOWN_KEYS = {"model", "optimizer", "extra_state", "dataloader"}


class SaveHandle:
    """Result of ``save``: ``wait()`` blocks until committed (re-raising any error), ``done()`` polls,
    ``wait_snapshot()`` blocks until the state at the call is copied (async saves)."""

    def __init__(self, future: Future[Metadata | None], snapshot: Future[None] | None = None) -> None:
        self._future = future
        self._snapshot = snapshot
        self._reported = False

    def wait_snapshot(self) -> None:
        """Block until the snapshot is complete: from then on the saved tensors may be changed in
        any way. (``optimizer.step()`` waits for it by itself.) A failed copy is reported by
        ``wait()``, not here."""
        if self._snapshot is not None:
            self._snapshot.exception()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Metadata | None:
        """Block until the save is committed; returns the metadata on rank 0 (None elsewhere)."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError("checkpoint save still running") from None
        except BaseException:
            self._reported = True
            raise

    def join(self, timeout: float | None = None) -> bool:
        """Block until the save finished (committed or failed) without raising; True if it did."""
        try:
            self._future.exception(timeout)
        except FutureTimeout:
            return False
        return True

    def take_unreported_error(self) -> BaseException | None:
        """For a finished save: its error if nobody has seen it yet (then it counts as seen)."""
        if not self._future.done() or self._reported:
            return None
        err = self._future.exception()
        self._reported = err is not None
        return err


_HANDLES: list[SaveHandle] = []  # async saves whose failure nobody has seen yet
_PLAN_CACHE: dict[tuple[str | None, str], CachedPlan] = {}


def _raise_unreported_failures() -> None:
    """Surface a failed background save in the next save/load, never silently."""
    done = [h for h in _HANDLES if h.done()]
    _HANDLES[:] = [h for h in _HANDLES if not h.done()]
    for h in done:
        err = h.take_unreported_error()
        if err is not None:
            raise CheckpointError(f"a previous asynchronous save failed: {err}") from err


def _open(path: str, role: str | None) -> Storage:
    if role is not None:
        if not role or "/" in role or role.startswith("."):
            raise ValueError(f"invalid role {role!r}")
        path = f"{str(path).rstrip('/')}/{role}"
    return open_storage(str(path))


def _check_state(state: MutableMapping[str, Any]) -> None:
    if not isinstance(state, MutableMapping):
        raise FrameworkError(f"state must be a dict, got {type(state).__name__}")
    unknown = set(state) - _KNOWN_KEYS
    if unknown:
        raise FrameworkError(f"unknown state keys {sorted(unknown)}; expected some of {sorted(_KNOWN_KEYS)}")


def save(
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
    writing and the commit run on the background worker, after any earlier save."""
    options = options or SaveOptions()
    _check_state(state)
    _raise_unreported_failures()
    t0 = time.perf_counter()
    storage = _open(path, role)
    coord = make_coordinator(channel="foreground")
    emit("save.begin", coord.rank, path=storage.url)
    adapter = get_framework(framework, state)
    view = run_stage(coord, "save (describe state)", lambda: adapter.save_view(state))
    blobs = _blobs_to_save(state, coord.rank)
    local = LocalSavePlan(
        coord.rank, tuple(i.spec for i in view.items), tuple(BlobSpec(k, len(v)) for k, v in blobs.items())
    )
    key = (role, adapter.name)
    with phase("save.plan", coord.rank, path=storage.url):
        cached = plan_stage(coord, local, options.files_per_rank, _PLAN_CACHE.get(key))
    _PLAN_CACHE[key] = cached
    gplan = cached.plan
    rank_plan = gplan.rank_plans[coord.rank]
    request = SaveRequest(adapter.name, role, view.mesh)
    objects = view.objects  # every rank's: merged per parameter at commit (pipeline stages differ)
    background = make_coordinator(channel="background")

    if async_save:
        later = _copied_later(state, options)
        with phase("save.stage", coord.rank, path=storage.url, save_id=gplan.save_id) as p:
            staged = run_stage(coord, "save (stage)", lambda: STAGING_POOL.stage(view.items, rank_plan, blobs, later))
            p.nbytes = staged.nbytes
        if staged.copied is not None:
            step_guard.guard(state["optimizer"], staged.copied)
        images = {f: memoryview(parts[0]) if parts else memoryview(b"") for f, parts in staged.parts.items()}
        entry_bytes: list[Buffer] = [
            images[e.file][e.byte_offset : e.byte_offset + e.byte_length] for e in rank_plan.entries
        ]
        file_parts = staged.parts
    else:
        staged = None
        file_parts = live_parts(view.items, rank_plan, blobs)
        entry_bytes = _plan_order(rank_plan, file_parts)

    def write_and_commit(lock: SaveLock) -> Metadata | None:
        crcs, error = None, None
        try:
            if staged is not None:
                staged.wait_ready()
            with phase("save.write", coord.rank, path=storage.url, save_id=gplan.save_id) as p:
                crcs = write_stage(storage, rank_plan, entry_bytes, file_parts, options.io_threads)
                p.nbytes = rank_plan.nbytes
        except Exception as e:  # reported to all ranks by commit_stage
            error = e
        finally:
            if staged is not None:
                staged.release()
        md = commit_stage(
            background,
            storage,
            gplan,
            crcs,
            error,
            request,
            objects,
            options.cleanup_previous,
            still_locked=lock.verify_holder,
        )
        emit("save.end", coord.rank, t0, path=storage.url, save_id=gplan.save_id, nbytes=rank_plan.nbytes)
        return md

    # under the save lock: one save per path; a failed save's partial data is discarded
    handle = SaveHandle(
        SAVE_WORKER.submit(
            lambda: run_locked(
                background,
                storage,
                rank_plan,
                write_and_commit,
                on_refused=staged.release if staged else None,
                lease_s=options.lock_lease_s,
            )
        ),
        staged.copied if staged is not None else None,
    )
    if not async_save:
        handle.wait()
    else:
        _HANDLES.append(handle)
    return handle


def _copied_later(state: MutableMapping[str, Any], options: SaveOptions) -> Callable[[SaveItem], bool] | None:
    """Which save items an async save may copy after returning: those only optimizer.step()
    changes (it waits for the copy; see engine.step_guard). None: copy everything in the call."""
    optimizer = state.get("optimizer")
    if not options.background_snapshot or not isinstance(optimizer, torch.optim.Optimizer):
        return None
    protected = step_guard.protected_storages(optimizer)
    return lambda item: step_guard.storage_key(item.tensor) in protected


def _plan_order(plan: RankSavePlan, file_parts: dict[str, list[Buffer]]) -> list[Buffer]:
    """Each entry's bytes, in plan order, picked out of ``live_parts``' per-file lists."""
    cursor = {f: 0 for f in file_parts}
    ends: dict[str, int] = {}
    out = []
    for e in plan.entries:
        if e.byte_offset != ends.get(e.file, 0):
            cursor[e.file] += 1  # skip the padding part
        ends[e.file] = e.byte_offset + e.byte_length
        out.append(file_parts[e.file][cursor[e.file]])
        cursor[e.file] += 1
    return out


def _blobs_to_save(state: MutableMapping[str, Any], rank: int) -> dict[str, bytes]:
    blobs = {}
    if state.get("extra_state") is not None:
        blobs[extra_blob_key(rank)] = dumps_value(state["extra_state"], "extra_state")
    loader = state.get("dataloader")
    if loader is not None:
        if not hasattr(loader, "state_dict"):
            raise FrameworkError('state["dataloader"] must have state_dict()/load_state_dict()')
        blobs[f"dataloader/rank{rank}"] = dumps_value(loader.state_dict(), "dataloader")
    return blobs


def load(
    path: str,
    state: MutableMapping[str, Any],
    *,
    framework: str = "auto",
    strict: bool = True,
    role: str | None = None,
    options: LoadOptions | None = None,
) -> None:
    """Load the checkpoint at ``path`` into ``state`` in place, resharding as needed.

    Everything is validated on every rank before anything in ``state`` changes (``_load``); the
    optimizer's state becomes exactly the checkpoint's (a rollback: state the checkpoint does not
    have is removed, gradients are untouched)."""
    options = options or LoadOptions()
    _check_state(state)
    SAVE_WORKER.drain()  # a save in flight commits first (it may target this path)
    _raise_unreported_failures()
    t_load = time.perf_counter()
    storage = _open(path, role)
    coord = make_coordinator(channel="foreground")
    emit("load.begin", coord.rank, path=storage.url)
    adapter = get_framework(framework, state)
    for attempt in range(_LOAD_ATTEMPTS):
        with phase("load.metadata", coord.rank, path=storage.url):
            md = read_metadata(coord, storage, options.max_metadata_bytes)
        try:
            missing, unexpected = load_once(md, storage, coord, adapter, state, strict, options)
            break
        except (MissingDataFileError, TruncatedDataFileError, ChecksumMismatchError, RankFailures):
            # another job may have committed a newer checkpoint here and deleted the data this load
            # was reading: start over on the new metadata (never a mix: every byte is re-read)
            if attempt + 1 == _LOAD_ATTEMPTS or not checkpoint_replaced(coord, storage, md.save_id):
                raise
    emit("load.end", coord.rank, t_load, path=storage.url)
    if (missing or unexpected) and coord.rank == 0:
        warnings.warn(
            f"non-strict load of {storage.url}: skipped {len(missing)} live key(s) missing from the "
            f"checkpoint {missing[:10]} and {len(unexpected)} checkpoint key(s) the state lacks "
            f"{unexpected[:10]}",
            stacklevel=2,
        )
