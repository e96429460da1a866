"""``unickpt.save`` / ``unickpt.load``: build the pipeline (adapter -> planner -> engine -> storage).

Who calls what, in order, on every rank:
  save: wait for the previous save (one in flight) -> adapter.save_view -> plan (collective, cached
        while the sharding is unchanged) -> stage (snapshot) -> [background if async] write ->
        commit (collective) -> handle done.
  load: wait for any save in flight -> adapter.load_view -> read metadata (collective) ->
        validate keys/shapes/dtypes -> plan -> read + copy in place -> agree (collective) ->
        param groups and extra state applied.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, MutableMapping


from .coordination import Coordinator, make_coordinator, run_stage
from .engine.load import read_blob, read_metadata, read_stage
from .engine.save import SaveRequest, commit_stage, plan_stage, write_stage
from .engine.staging import stage_items
from .errors import CheckpointError, FrameworkError
from .format.records import Metadata
from .format.values import dumps_value, loads_value
from .frameworks import get_framework
from .options import LoadOptions, SaveOptions
from .planning.load_plan import check_targets, plan_local_load
from .planning.save_plan import GlobalSavePlan, LocalSavePlan
from .planning.specs import BlobSpec
from .state.extra import extra_blob_key, pick_extra_blob
from .storage import Storage, open_storage

__all__ = ["save", "load", "SaveHandle"]

_KNOWN_KEYS = {"model", "optimizer", "extra_state", "dataloader"}


class SaveHandle:
    """Result of ``save``: ``wait()`` blocks until committed (re-raising any error), ``done()`` polls."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._metadata: Metadata | None = None
        self._reported = False

    def _finish(self, metadata: Metadata | None, error: BaseException | None) -> None:
        self._metadata, self._error = metadata, error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Metadata | None:
        """Block until the save is committed; returns the metadata on rank 0 (None elsewhere)."""
        if not self._event.wait(timeout):
            raise TimeoutError("checkpoint save still running")
        if self._error is not None:
            self._reported = True
            raise self._error
        return self._metadata


_IN_FLIGHT: SaveHandle | None = None
_PLAN_CACHE: dict[tuple[str | None, str], tuple[LocalSavePlan, GlobalSavePlan]] = {}


def _wait_in_flight() -> None:
    global _IN_FLIGHT
    prev, _IN_FLIGHT = _IN_FLIGHT, None
    if prev is not None:
        try:
            prev.wait()
        except BaseException as e:
            if not prev._reported:
                raise CheckpointError(f"the previous asynchronous save failed: {e}") from e


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


def save(path: str, state: MutableMapping[str, Any], *, framework: str = "auto",
         async_save: bool = False, role: str | None = None,
         options: SaveOptions | None = None) -> SaveHandle:
    """Save ``state`` (model, optimizer, extra_state, dataloader) to ``path`` from every rank."""
    options = options or SaveOptions()
    _check_state(state)
    _wait_in_flight()
    storage = _open(path, role)
    coord = make_coordinator()
    adapter = get_framework(framework, state)
    view = run_stage(coord, "save (describe state)", lambda: adapter.save_view(state))
    blobs = _blobs_to_save(state, coord.rank)
    local = LocalSavePlan(coord.rank, tuple(i.spec for i in view.items),
                          tuple(BlobSpec(k, len(v)) for k, v in blobs.items()))
    key = (role, adapter.name)
    rank_plan, gplan = plan_stage(coord, local, options.files_per_rank, _PLAN_CACHE.get(key))
    if gplan is not None:
        _PLAN_CACHE[key] = (local, gplan)
    request = SaveRequest(adapter.name, role, view.mesh, options.files_per_rank)
    objects = view.objects if coord.rank == 0 else {}
    written = {e.item_index for e in rank_plan.entries if not e.blob_key}
    item_bytes = run_stage(coord, "save (stage)",
                           lambda: stage_items(view.items, written, copy=async_save))
    handle = SaveHandle()

    def write_and_commit() -> None:
        crcs, error = None, None
        try:
            crcs = write_stage(storage, rank_plan, item_bytes, blobs, options.io_threads)
        except BaseException as e:  # reported to all ranks by commit_stage
            error = e
        md = commit_stage(coord, storage, gplan, crcs, error, request, objects, options.cleanup_previous)
        handle._finish(md, None)

    if not async_save:
        write_and_commit()
        return handle

    def background() -> None:
        try:
            write_and_commit()
        except BaseException as e:
            handle._finish(None, e)

    global _IN_FLIGHT
    _IN_FLIGHT = handle
    threading.Thread(target=background, name="unickpt-async-save", daemon=True).start()
    return handle


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


def load(path: str, state: MutableMapping[str, Any], *, framework: str = "auto",
         strict: bool = True, role: str | None = None, options: LoadOptions | None = None) -> None:
    """Load the checkpoint at ``path`` into ``state`` in place, resharding as needed."""
    options = options or LoadOptions()
    _check_state(state)
    _wait_in_flight()
    storage = _open(path, role)
    coord = make_coordinator()
    adapter = get_framework(framework, state)
    md = read_metadata(coord, storage)
    view = run_stage(coord, "load (describe state)", lambda: adapter.load_view(state))
    specs = [i.spec for i in view.items]
    ckpt_keys = {k for k in md.tensors if k.startswith(view.prefixes)} if view.prefixes else set()

    def local_load() -> tuple[list[str], list[str]]:
        report = check_targets(md, specs, strict=strict, source=storage.url, checkpoint_keys=ckpt_keys)
        reads = plan_local_load(md, specs)
        read_stage(md, storage, view.items, reads, coord.rank, options.io_threads, options.verify_checksums)
        skipped = view.finish(md.objects, strict)
        _restore_blobs(md, storage, state, coord, strict)
        return list(report.missing) + skipped, list(report.unexpected)

    missing, unexpected = run_stage(coord, "load", local_load)
    if (missing or unexpected) and coord.rank == 0:
        warnings.warn(
            f"non-strict load of {storage.url}: skipped {len(missing)} live key(s) missing from the "
            f"checkpoint {missing[:10]} and {len(unexpected)} checkpoint key(s) the state lacks "
            f"{unexpected[:10]}", stacklevel=2)


def _restore_blobs(md: Metadata, storage: Storage, state: MutableMapping[str, Any],
                   coord: Coordinator, strict: bool) -> None:
    keys = set(md.blobs)
    if "extra_state" in state:
        key = pick_extra_blob(keys, coord.rank, md.topology.world_size)
        if key is None:
            if strict:
                from .errors import MissingKeysError

                raise MissingKeysError(f"checkpoint {storage.url} has no extra_state")
        else:
            state["extra_state"] = loads_value(read_blob(md, storage, md.blobs[key], coord.rank), key)
    loader = state.get("dataloader")
    if loader is not None:
        ws = md.topology.world_size
        key = next((k for k in (f"dataloader/rank{coord.rank}", f"dataloader/rank{coord.rank % ws}")
                    if k in keys), None)
        if key is None:
            if strict:
                from .errors import MissingKeysError

                raise MissingKeysError(f"checkpoint {storage.url} has no dataloader state")
        else:
            loader.load_state_dict(loads_value(read_blob(md, storage, md.blobs[key], coord.rank), key))


