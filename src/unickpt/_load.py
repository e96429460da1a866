"""One attempt of ``unickpt.load`` on one committed metadata: validate, read, apply.

``api.load`` calls ``load_once`` (again, on the new metadata, if another job replaced the
checkpoint while it read). Stages, every rank, * = collective on the checkpoint group:

  validate*  ``adapter.load_view(state, md, strict)`` (destinations; fresh tensors for optimizer
             state the live optimizer lacks, nothing installed), ``check_targets`` (shapes,
             dtypes), probes read (FSDP1 flat steps, into scratch), ``view.validate()``
             (param groups, hyper-parameter types, flat steps agree), blob presence; then every
             rank's missing and unexpected keys are combined (a key is unexpected only if no
             rank responsible for it wants it: pipeline stages hold different parameters), so
             every rank raises the same error under ``strict``. Nothing in the job changed yet.
  read*      ``engine.load.read_stage`` fills the destinations: live tensors in place (a failure
             then says plainly that live tensors were partly overwritten), or with
             ``LoadOptions(stage_before_apply=True)`` staging buffers, every checksum verified
             on every rank before anything live is touched; extra state / dataloader blobs read
             and decoded.
  apply*     staging copied into the live tensors, ``view.apply()`` (optimizer state installed,
             state the checkpoint does not have removed, param groups set), extra state and
             dataloader state set.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

from .coordination import Coordinator, SingleProcessCoordinator, run_stage
from .engine.load import read_blob, read_stage
from .errors import CheckpointError
from .format.records import Metadata
from .format.values import loads_value
from .frameworks import FrameworkAdapter, LoadView
from .monitoring.events import phase
from .options import LoadOptions
from .planning.load_plan import ShardRead, check_targets, keys_error, plan_local_load
from .planning.specs import LoadItem
from .state.extra import pick_extra_blob
from .storage import Storage

__all__ = ["load_once"]

_EXTRA, _LOADER = "extra_state", "dataloader"
_ONE = SingleProcessCoordinator()  # probes: each rank reads its own, no collective


def load_once(
    md: Metadata,
    storage: Storage,
    coord: Coordinator,
    adapter: FrameworkAdapter,
    state: MutableMapping[str, Any],
    strict: bool,
    options: LoadOptions,
) -> tuple[list[str], list[str]]:
    """Validate, read and apply ``md`` into ``state``; returns the keys a non-strict load skipped
    (missing from the checkpoint, unexpected in it)."""
    source = storage.url

    def validate() -> tuple[LoadView, list[ShardRead], dict[str, str], list[str], list[str]]:
        view = adapter.load_view(state, md, strict)
        ckpt_keys = {k for k in md.tensors if k.startswith(view.prefixes)} if view.prefixes else set()
        specs = [i.spec for i in view.items] + [i.spec for i in view.probes]
        report = check_targets(
            md, specs, strict=False, source=source, checkpoint_keys=ckpt_keys, cast_dtypes=options.cast_dtypes
        )
        if view.probes:
            reads = plan_local_load(md, [i.spec for i in view.probes])
            read_stage(md, storage, _ONE, view.probes, reads, 1, options.verify_checksums, False)
        missing, unexpected = view.validate()
        blobs, absent = _blob_keys(md, state, coord)
        return (
            view,
            plan_local_load(md, [i.spec for i in view.items]),
            blobs,
            list(report.missing) + missing + absent,
            list(report.unexpected) + unexpected,
        )

    with phase("load.plan", coord.rank, path=source):
        view, reads, blobs, missing, unexpected = run_stage(coord, "load (validate)", validate)
        missing, unexpected = _agree_keys(coord, missing, unexpected, view.prefixes)
    if strict and (missing or unexpected):
        raise keys_error(missing, unexpected, source)

    staged = options.stage_before_apply
    targets = [i if i.fresh else LoadItem(i.spec, _staging(i.tensor), True) for i in view.items] if staged else None
    try:
        with phase("load.read", coord.rank, path=source) as p:
            p.nbytes = read_stage(
                md,
                storage,
                coord,
                targets if targets is not None else view.items,
                reads,
                options.io_threads,
                options.verify_checksums,
                options.dedup_reads,
            )
        values = run_stage(
            coord,
            "load (read extra state)",
            lambda: _read_blobs(md, storage, blobs, coord.rank, options.max_blob_bytes),
        )
    except CheckpointError as e:
        if not staged and any(not i.fresh for i in view.items):
            _say_partial(e)
        raise

    def apply() -> None:
        if targets is not None:
            with torch.no_grad():
                for live, stage in zip(view.items, targets):
                    if live is not stage:
                        live.tensor.copy_(stage.tensor)
        view.apply()
        if _EXTRA in values:
            state[_EXTRA] = values[_EXTRA]
        if _LOADER in values:
            state[_LOADER].load_state_dict(values[_LOADER])

    run_stage(coord, "load (apply)", apply)
    return missing, unexpected


def _staging(live: torch.Tensor) -> torch.Tensor:
    """A CPU buffer with the live destination's shape and dtype (casts happen while reading)."""
    return torch.empty(tuple(live.shape), dtype=live.dtype)


def _say_partial(e: CheckpointError) -> None:
    """Make the message of a failure after bytes may have landed say so (same error object)."""
    note = (
        "\nThis load had already written into live tensors of the model/optimizer: they are now "
        "partially overwritten and must not be trained on. Load a good checkpoint; pass "
        "options=unickpt.LoadOptions(stage_before_apply=True) to verify every byte before touching them."
    )
    if e.args and isinstance(e.args[0], str):
        e.args = (e.args[0] + note, *e.args[1:])
    else:
        e.add_note(note)


def _agree_keys(
    coord: Coordinator, missing: list[str], unexpected: list[str], prefixes: tuple[str, ...]
) -> tuple[list[str], list[str]]:
    """Every rank's missing keys (union) and the checkpoint keys no responsible rank wants (a
    key is unexpected when every rank whose view covers its prefix found it unexpected)."""
    if coord.world_size == 1:
        return sorted(set(missing)), sorted(set(unexpected))
    gathered = coord.all_gather_object((sorted(set(missing)), sorted(set(unexpected)), prefixes))
    all_missing = sorted({k for m, _, _ in gathered for k in m})
    candidates = {k for _, u, _ in gathered for k in u}
    sets = [(set(u), p) for _, u, p in gathered]
    return all_missing, sorted(k for k in candidates if all(k in u for u, p in sets if p and k.startswith(p)))


def _blob_keys(md: Metadata, state: MutableMapping[str, Any], coord: Coordinator) -> tuple[dict[str, str], list[str]]:
    """Which blob to read for extra state / dataloader state, and which the checkpoint lacks."""
    keys = set(md.blobs)
    chosen: dict[str, str] = {}
    absent = []
    if _EXTRA in state:
        key = pick_extra_blob(keys, coord.rank, md.topology.world_size)
        if key is None:
            absent.append(_EXTRA)
        else:
            chosen[_EXTRA] = key
    if state.get(_LOADER) is not None:
        ws = md.topology.world_size
        key = next(
            (k for k in (f"dataloader/rank{coord.rank}", f"dataloader/rank{coord.rank % ws}") if k in keys), None
        )
        if key is None:
            absent.append(_LOADER)
        else:
            chosen[_LOADER] = key
    return chosen, absent


def _read_blobs(md: Metadata, storage: Storage, chosen: dict[str, str], rank: int, cap: int) -> dict[str, Any]:
    return {what: loads_value(read_blob(md, storage, md.blobs[key], rank, cap), key) for what, key in chosen.items()}
