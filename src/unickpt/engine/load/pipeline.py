"""The load pipeline: one load on one rank, validated before anything in the job changes.

``Checkpointer.load`` creates a ``LoadPipeline`` and calls ``run``. Stages, every rank
(* = collective on the checkpointer's foreground group):

  groups*    (``__init__``) the foreground coordinator; the checkpointer's first save or load
             creates unickpt's process groups here (every rank), later ones reuse them. Its
             time is the ``load.groups`` event, emitted by ``run`` right after ``load.begin``
             (``load.begin`` and ``load.end`` start where this stage started);

  describe*  the state dict is valid (``state.layout``: every key and its kind) and every rank
             loads the same path, framework and role (before anything is read); each rank's
             host name, and whether its storage reads only through that host's page cache,
             ride along (``Share``): a load whose ranks all run on one host and all read so
             needs no exchange of needs in ``read`` (``one_cache``, the same on every rank);
  metadata*  rank 0 reads the metadata (bounded), every rank decodes the same bytes;
  validate*  ``adapter.load_view(state, md, strict)`` (destinations; fresh tensors for optimizer
             state the live optimizer lacks, nothing installed), with
             ``RestoreOptions(resize_plain_tensors=True)`` ``resize.plan_resizes`` (a plain
             tensor saved with another shape gets a fresh destination of that shape, its data
             files checked first), ``check_targets`` (shapes,
             dtypes), probes read (FSDP1 flat steps, into scratch), ``view.validate()``
             (param groups, hyper-parameter types, flat steps agree), the other items' blobs
             (``StateLayout.choose``) and the top-level keys (``keys_against``); then every
             rank's missing and unexpected keys are combined, in the stage's own all_gather
             (``Share``; a key is unexpected only if no rank responsible for it wants it:
             pipeline stages hold different parameters), so every rank raises the same error
             under ``strict``. Nothing in the job changed yet.
  read*      ``engine.load.stage.read_stage`` fills the destinations: live tensors in place (a failure
             then says plainly that live tensors were partly overwritten), or with
             ``LoadOptions(stage_before_apply=True)`` staging buffers, every checksum verified
             on every rank before anything live is touched; then the other items' blobs read
             and decoded, agreed on with the reads in one all_gather.
  apply*     the resized tensors handed to their modules (``Resizes.apply``), staging copied
             into the live tensors, ``view.apply()`` (optimizer state installed,
             state the checkpoint does not have removed, param groups set), then every other
             item applied (``StateLayout.apply``: dataloader, values, stateful objects).
If another job re-commits the checkpoint while this load reads (its data goes away), the load
starts over from ``metadata`` on the new metadata (never a mix: every byte is re-read).
A load changes the live state, so it is blocking by nature: ``run`` returns when it is applied.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from ...coordination import Coordinator, Share, SingleProcessCoordinator, run_stage
from ...errors import CheckpointError, IntegrityError, RankFailures
from ...folder.lock import checkpoint_replaced
from ...folder.target import claims
from ...format.keymap import remap
from ...format.records import Metadata
from ...format.transforms import derive
from ...format.values import loads_value
from ...frameworks import FrameworkAdapter, LoadView, get_framework
from ...monitoring.events import EventBus, instrumented
from ...options import LoadOptions
from ...planning.load.overlap import ShardRead, plan_local_load
from ...planning.load.shards import ShardIndex
from ...planning.load.targets import check_targets, keys_error
from ...planning.specs import LoadItem
from ...state.items import LoadContext
from ...state.layout import StateLayout
from ...storage import Storage
from ..gc_pause import gc_paused
from ..read import read_blob, read_metadata
from ..runtime.resources import Resources
from .resize import NO_RESIZES, Resizes, plan_resizes
from .schedule import ReaderThreads
from .stage import read_stage

__all__ = ["LoadPipeline"]

_LOAD_ATTEMPTS = 3

_ONE = SingleProcessCoordinator()  # probes: each rank reads its own, no collective


class LoadPipeline:
    """One load of the checkpoint in ``storage`` into ``state`` on this rank (see the module
    docstring)."""

    def __init__(
        self,
        res: Resources,
        storage: Storage,
        state: MutableMapping[str, Any],
        *,
        framework: str,
        strict: bool,
        role: str | None,
        options: LoadOptions,
    ) -> None:
        self.res, self.storage, self.state = res, storage, state
        self.framework, self.strict, self.role, self.options = framework, strict, role, options
        self.t0 = time.perf_counter()  # the load starts here: process groups may be created next
        self.coord: Coordinator = res.coordinator("foreground", options.timeout, f"load of {storage.url}")
        self.t_groups = time.perf_counter()  # the "load.groups" phase: self.t0 .. here
        self.one_cache = False  # every rank reads through one host's page cache (``describe``)

    def describe(self) -> tuple[StateLayout, FrameworkAdapter]:
        """Collective: every rank has a valid state and agrees on what it loads; ``one_cache``
        set from every rank's host name and storage, shared in the same round trip (a rank of
        the RAM tier's recovery may read through a wrapper of its own, ``recovery.feed``)."""

        def local() -> tuple[StateLayout, FrameworkAdapter]:
            layout = StateLayout.of(self.state)
            return layout, get_framework(self.framework, layout.framework_state)

        caps = self.storage.capabilities
        mine = (socket.gethostname(), caps.shared_page_cache and caps.reads_ahead)  # no direct reads

        def hosts(seen: list[Any]) -> None:  # every rank's ``mine``, in rank order
            self.one_cache = len({h for h, _ in seen}) == 1 and all(c for _, c in seen)

        return run_stage(
            self.coord,
            "load (describe state)",
            local,
            agree=lambda d: claims("load", self.storage.url, d[1].name, self.role),
            share=Share(lambda _: mine, hosts),
        )

    @instrumented("load.metadata")
    def metadata(self) -> Metadata:
        """Collective: the committed metadata (rank 0 reads, every rank decodes)."""
        md = read_metadata(self.coord, self.storage, self.options.limits.max_metadata_bytes)
        return derive(remap(md, self.options.restore.key_map), self.options.restore.transforms)

    def run(self) -> tuple[list[str], list[str]]:
        """The whole load; returns the keys a non-strict load skipped (missing from the
        checkpoint, unexpected in it)."""
        coord, storage, t0 = self.coord, self.storage, self.t0
        self.res.events.emit("load.begin", coord.rank, t0, end=t0, path=storage.url)
        self.res.events.emit("load.groups", coord.rank, t0, end=self.t_groups, path=storage.url)
        with self.res.events.phase("load.describe", coord.rank, path=storage.url):
            layout, adapter = self.describe()
        with gc_paused(self.options.pause_gc):  # a record per shard and tensor: no full collections
            skipped = self._attempts(layout, adapter)
        self.res.events.emit("load.end", coord.rank, t0, path=storage.url)
        return skipped

    def _attempts(self, layout: StateLayout, adapter: FrameworkAdapter) -> tuple[list[str], list[str]]:
        coord, storage = self.coord, self.storage
        for attempt in range(_LOAD_ATTEMPTS):
            md = self.metadata()
            try:
                skipped = _load_once(
                    self.res.events,
                    md,
                    storage,
                    coord,
                    (layout, adapter),
                    self.state,
                    self.strict,
                    self.options,
                    one_cache=self.one_cache,
                    kept=self.res.readers,
                )
                break
            except (IntegrityError, RankFailures):
                # another job may have committed a newer checkpoint here and deleted the data this
                # load was reading: start over on the new metadata (never a mix: every byte is re-read)
                if attempt + 1 == _LOAD_ATTEMPTS or not checkpoint_replaced(coord, storage, md.save_id):
                    raise
        return skipped


@dataclass(frozen=True)
class _Validated:
    """What the validate stage found on this rank: the framework's view (destinations, probes),
    the saved shards to read, the blobs to read, the missing and unexpected keys."""

    view: LoadView
    reads: list[ShardRead]
    blobs: dict[tuple[str, str], str]
    missing: list[str]
    unexpected: list[str]
    resizes: Resizes = NO_RESIZES  # plain tensors taking their saved shape (``resize``)


def _load_once(
    events: EventBus,
    md: Metadata,
    storage: Storage,
    coord: Coordinator,
    described: tuple[StateLayout, FrameworkAdapter],
    state: MutableMapping[str, Any],
    strict: bool,
    options: LoadOptions,
    *,
    one_cache: bool = False,
    kept: ReaderThreads | None = None,
) -> tuple[list[str], list[str]]:
    """Validate, read and apply ``md`` into ``state`` (one attempt; the caller, ``run``, keeps
    the cyclic collector paused throughout); ``one_cache``: every rank reads through one host's page cache;
    ``kept``: the checkpointer's reader threads."""
    source = storage.url
    layout, adapter = described
    own: dict[tuple[str, str], Any] = {}  # a Stateful's tensors, by (item, key)
    agreed: list[tuple[list[str], list[str]]] = []  # every rank's missing/unexpected keys, combined
    keys = Share(
        lambda f: (sorted(set(f.missing)), sorted(set(f.unexpected)), f.view.prefixes),
        lambda gathered: agreed.append(_agree_keys(gathered)),
    )
    with events.phase("load.plan", coord.rank, path=source):
        found = run_stage(
            coord,
            "load (validate)",
            lambda: _validate(md, storage, coord, layout, adapter, strict, options, own),
            share=keys,
        )
    missing, unexpected = agreed[0]
    if strict and (missing or unexpected):
        raise keys_error(missing, unexpected, source)
    view = found.view
    values: dict[tuple[str, str], Any] = {}  # the other items' blobs, read within the read stage

    def read_blobs() -> None:
        values.update(_read_blobs(md, storage, found.blobs, coord.rank, options.limits.max_blob_bytes))

    targets = _read(events, md, storage, coord, view, found.reads, options, read_blobs, one_cache, kept)

    def apply() -> None:
        if found.resizes:
            try:
                found.resizes.apply()
            except CheckpointError as e:
                _say_partial_if(e, options.stage_before_apply, view)
                raise
        if targets is not view.items:
            with torch.no_grad():
                for live, stage in zip(view.items, targets):
                    if live is not stage:
                        live.tensor.copy_(stage.tensor)
        view.apply()
        layout.apply(state, {**values, **own})

    with events.phase("load.apply", coord.rank, path=source):
        run_stage(coord, "load (apply)", apply)
    return missing, unexpected


def _validate(
    md: Metadata,
    storage: Storage,
    coord: Coordinator,
    layout: StateLayout,
    adapter: FrameworkAdapter,
    strict: bool,
    options: LoadOptions,
    own: dict[tuple[str, str], Any],
) -> _Validated:
    """This rank's part of the validate stage: destinations (``adapter.load_view``, the
    Statefuls' tensors into ``own``), ``check_targets``, the probes read (into scratch), the
    view's own checks, the blobs chosen and the top-level keys; then the plan of this rank's
    reads. Nothing in the job changes."""
    view = adapter.load_view(layout.framework_state, md, strict)
    resizes = NO_RESIZES
    if options.restore.resize_plain_tensors:
        resizes = plan_resizes(md, storage, layout.framework_state, adapter, view.items, coord.rank)
    own_items, own_tensors, own_prefixes = layout.destinations(md)  # a Stateful's tensors
    view.items.extend(own_items)
    view.prefixes = (*view.prefixes, *own_prefixes)
    own.update(own_tensors)
    ckpt_keys = {k for k in md.tensors if k.startswith(view.prefixes)} if view.prefixes else set()
    specs = [i.spec for i in view.items] + [i.spec for i in view.probes]
    report = check_targets(
        md, specs, strict=False, source=storage.url, checkpoint_keys=ckpt_keys, cast_dtypes=options.restore.cast_dtypes
    )
    index = ShardIndex(md)  # one overlap index for this attempt's two plans
    if view.probes:
        reads = plan_local_load(md, [i.spec for i in view.probes], index)
        read_stage(md, storage, _ONE, view.probes, reads, 1, options.verify_checksums, False)
    missing, unexpected = view.validate()
    ctx = LoadContext(
        md,
        coord.rank,
        coord.world_size,
        options.restore.extra_state_on_resize,
        options.restore.loader_on_resize,
        frozenset(md.blobs),
    )
    blobs, absent = layout.choose(ctx)
    # top-level keys; a key no view covers (loader state, a scheduler) is unexpected only if
    # *no* rank has it (_agree_keys), since ranks that own no loader (TP ranks > 0) are normal
    top_missing, top_unexpected = layout.keys_against(md)
    return _Validated(
        view,
        plan_local_load(md, [i.spec for i in view.items], index),
        blobs,
        list(report.missing) + missing + absent + top_missing,
        list(report.unexpected) + unexpected + top_unexpected,
        resizes,
    )


def _read(
    events: EventBus,
    md: Metadata,
    storage: Storage,
    coord: Coordinator,
    view: LoadView,
    reads: list[ShardRead],
    options: LoadOptions,
    then: Callable[[], None],
    one_cache: bool = False,
    kept: ReaderThreads | None = None,
) -> list[LoadItem]:
    """Collective: the read stage into the destinations: the live tensors (returns
    ``view.items``), or with ``stage_before_apply`` staging buffers for every live one (returns
    those targets); ``then`` (the other items' blobs) runs after this rank's reads, within the
    stage's one round trip. A failure after bytes may have landed in live tensors says so."""
    staged = options.stage_before_apply
    targets = [i if i.fresh else LoadItem(i.spec, _staging(i.tensor), True) for i in view.items] if staged else None
    try:
        with events.phase("load.read", coord.rank, path=storage.url) as p:
            p.nbytes = read_stage(
                md,
                storage,
                coord,
                targets if targets is not None else view.items,
                reads,
                options.io.threads,
                options.verify_checksums,
                options.io.dedup_reads,
                events,
                pinned_device_copies=options.io.pinned_device_copies,
                then=then,
                one_cache=one_cache,
                kept=kept,
            )
    except CheckpointError as e:
        _say_partial_if(e, staged, view)
        raise
    return targets if targets is not None else view.items


def _say_partial_if(e: CheckpointError, staged: bool, view: LoadView) -> None:
    """``_say_partial`` when the reads went into live tensors (not staged, some not fresh)."""
    if not staged and any(not i.fresh for i in view.items):
        _say_partial(e)


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


def _agree_keys(gathered: list[Any]) -> tuple[list[str], list[str]]:
    """Every rank's missing keys (union) and the checkpoint keys no responsible rank wants (a
    key is unexpected when every rank whose view covers its prefix found it unexpected; a key no
    view covers, such as ``dataloader``, when every rank found it unexpected). ``gathered``:
    each rank's (missing, unexpected, prefixes), in rank order."""
    all_missing = sorted({k for m, _, _ in gathered for k in m})
    candidates = {k for _, u, _ in gathered for k in u}
    sets = [(set(u), p) for _, u, p in gathered]

    def unwanted(k: str) -> bool:
        covering = [u for u, p in sets if p and k.startswith(p)]
        return all(k in u for u in (covering if covering else [u for u, _ in sets]))

    return all_missing, sorted(k for k in candidates if unwanted(k))


def _read_blobs(
    md: Metadata, storage: Storage, chosen: dict[tuple[str, str], str], rank: int, cap: int
) -> dict[tuple[str, str], Any]:
    return {what: loads_value(read_blob(md, storage, md.blobs[key], rank, cap), key) for what, key in chosen.items()}
