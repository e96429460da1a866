"""``unickpt.save`` / ``unickpt.load``: build the pipeline (adapter -> planner -> engine -> storage).

Who calls what, in order, on every rank:
  save: describe (adapter.save_view, extra state encoded; collective: every rank learns all
        succeeded, that all pass the same path, framework and role, and raises the unseen
        failures of async saves finished on every rank) -> plan (collective, cached while the
        sharding and layout options are unchanged; carries rank 0's fresh save id) -> stage
        (snapshot; async: buffers in the call, the optimizer's parameters and state on the
        snapshot thread, which its next step() waits for) -> [background if async] write ->
        commit (collective) -> handle done.
  load: wait for any save in flight, raise unreported async failures -> describe (collective:
        every rank has a valid state and the same path, framework and role) -> read metadata
        (collective) -> ``_load.load_once``: adapter.load_view + validate everything (keys,
        shapes, dtypes, param groups; agreed across ranks) -> read + copy in place (or into
        staging) -> apply (optimizer state, param groups, extra state) on every rank.
Async saves, their failure reports and the exit drain live in ``engine.worker.SAVE_WORKER``;
unickpt's process groups and their deadlines in ``coordination.torch_dist.GROUPS``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, MutableMapping
from typing import Any

from ._load import load_once
from .coordination import Settle, make_coordinator, run_stage
from .engine import step_guard
from .engine.load import read_metadata
from .engine.lock import SaveLock, checkpoint_replaced, run_locked
from .engine.save import PlanCache, PlanKey, SaveRequest, commit_stage, plan_stage, write_stage
from .engine.staging import STAGING_POOL, live_parts
from .engine.worker import SAVE_WORKER, SaveHandle
from .errors import (
    CheckpointError,
    ChecksumMismatchError,
    FrameworkError,
    MissingDataFileError,
    RankFailures,
    TruncatedDataFileError,
    UnsupportedValueError,
)
from .format.records import DATA_DIR, Metadata
from .format.values import dumps_value
from .frameworks import FrameworkAdapter, SaveView, get_framework, supports_step_hooks
from .monitoring.events import emit, phase
from .options import LoadOptions, SaveOptions
from .planning.save_plan import LocalSavePlan, RankSavePlan
from .planning.specs import BlobSpec, SaveItem
from .state.extra import extra_blob_key
from .storage import Buffer, Storage, open_storage

__all__ = ["save", "load", "wait_all", "SaveHandle", "check_role"]

_LOAD_ATTEMPTS = 3
_KNOWN_KEYS = {"model", "optimizer", "extra_state", "dataloader"}


_PLAN_CACHE = PlanCache()


def wait_all() -> None:
    """Block until every asynchronous save of this process (``unickpt.save`` and every
    ``CheckpointManager``) has committed or failed; raise ``AsyncSaveFailures`` naming each
    failure nobody has seen yet. Call it (on every rank) before
    ``torch.distributed.destroy_process_group()``, which also destroys unickpt's groups."""
    SAVE_WORKER.wait_all()


def check_role(role: str | None) -> None:
    """A role names a sub-folder of the checkpoint folder: one path component that cannot be
    taken for the folder's own files (``data/``, ``unickpt.*``) or hidden."""
    if role is None:
        return
    if not isinstance(role, str) or not role or "/" in role or "\\" in role or role.startswith("."):
        raise ValueError(f"invalid role {role!r}: one folder name, not empty, no '/', not starting with '.'")
    if role == DATA_DIR or role.startswith("unickpt"):
        raise ValueError(f"invalid role {role!r}: {DATA_DIR!r} and names starting with 'unickpt' are reserved")


def _open(path: str, role: str | None) -> Storage:
    check_role(role)
    if role is not None:
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
    writing and the commit run on the background worker, after any earlier save; a failure
    nobody waited for is raised by the next save/load or ``wait_all()``, or reported at exit
    (the process then exits non-zero). Every rank must pass the same path, framework and role."""
    return save_tracked(path, state, framework=framework, async_save=async_save, role=role, options=options)


def save_tracked(
    path: str,
    state: MutableMapping[str, Any],
    *,
    framework: str = "auto",
    async_save: bool = False,
    role: str | None = None,
    options: SaveOptions | None = None,
    track: bool = True,
    owner: object = None,
    what: str = "",
) -> SaveHandle:
    """``save``. ``owner``/``what``: whose unseen async failures this save reports first (a
    ``CheckpointManager`` passes itself and `` of <root>``); ``track=False`` when the caller
    reports this async save's failure through its own handle (the manager does)."""
    options = options or SaveOptions()
    t0 = time.perf_counter()
    storage = _open(path, role)
    label = f"save of {storage.url}"
    coord = make_coordinator(channel="foreground", timeout=options.timeout, label=label)
    emit("save.begin", coord.rank, path=storage.url)

    def describe() -> tuple[FrameworkAdapter, SaveView, dict[str, bytes]]:
        _check_state(state)
        adapter = get_framework(framework, state)
        return adapter, adapter.save_view(state), _blobs_to_save(state, coord.rank)

    # the first collective: every rank learns whether all could describe their state and agree
    # on what they save, and reports the async failures of the saves finished on every rank
    # (before anything is written)
    unseen = Settle(lambda: SAVE_WORKER.finished(owner), lambda n: SAVE_WORKER.raise_failures(owner, what, n))
    adapter, view, blobs = run_stage(
        coord,
        "save (describe state)",
        describe,
        agree=lambda r: _claims("save", storage.url, r[0], role),
        settle=unseen,
    )
    local = LocalSavePlan(
        coord.rank, tuple(i.spec for i in view.items), tuple(BlobSpec(k, len(v)) for k, v in blobs.items())
    )
    key = PlanKey(role, adapter.name, options.files_per_rank)
    with phase("save.plan", coord.rank, path=storage.url):
        cached = plan_stage(coord, local, options.files_per_rank, _PLAN_CACHE.get(key))
    _PLAN_CACHE.put(key, cached)
    gplan = cached.plan
    rank_plan = gplan.rank_plans[coord.rank]
    request = SaveRequest(adapter.name, role, view.mesh)
    objects = view.objects  # every rank's: merged per parameter at commit (pipeline stages differ)
    background = make_coordinator(channel="background", timeout=options.timeout, label=label)

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
        storage.url,
    )
    if not async_save:
        handle.wait()
    elif track:
        SAVE_WORKER.track(handle, owner)
    return handle


def _claims(operation: str, url: str, adapter: FrameworkAdapter, role: str | None) -> dict[str, object]:
    """What every rank of one save/load must pass alike (checked in its first collective)."""
    return {"operation": operation, "path": url, "framework": adapter.name, "role": role}


def _copied_later(state: MutableMapping[str, Any], options: SaveOptions) -> Callable[[SaveItem], bool] | None:
    """Which save items an async save may copy after returning: those only optimizer.step()
    changes (it waits for the copy; see engine.step_guard). None: copy everything in the call
    (also for an optimizer-like object without ``register_step_pre_hook``: nothing could wait)."""
    optimizer = state.get("optimizer")
    if optimizer is None or not options.background_snapshot or not supports_step_hooks(optimizer):
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
        blobs[extra_blob_key(rank)] = _encode(state["extra_state"], "extra_state")
    loader = state.get("dataloader")
    if loader is not None:
        if not hasattr(loader, "state_dict"):
            raise FrameworkError('state["dataloader"] must have state_dict()/load_state_dict()')
        blobs[f"dataloader/rank{rank}"] = _encode(loader.state_dict(), "dataloader")
    return blobs


def _encode(value: Any, where: str) -> bytes:
    """``dumps_value``, its refusals as ``UnsupportedValueError`` (a ``CheckpointError``)."""
    try:
        return dumps_value(value, where)
    except CheckpointError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise UnsupportedValueError(f"cannot save {where}: {e}") from e


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
    SAVE_WORKER.drain()  # a save in flight commits first (it may target this path)
    SAVE_WORKER.raise_failures()
    t_load = time.perf_counter()
    storage = _open(path, role)
    coord = make_coordinator(channel="foreground", timeout=options.timeout, label=f"load of {storage.url}")
    emit("load.begin", coord.rank, path=storage.url)

    def describe() -> FrameworkAdapter:
        _check_state(state)
        return get_framework(framework, state)

    # the first collective: every rank has a valid state and agrees on what it loads, before
    # anything is read (load_once's first stage needs the metadata, read next)
    adapter = run_stage(coord, "load (describe state)", describe, agree=lambda a: _claims("load", storage.url, a, role))
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
