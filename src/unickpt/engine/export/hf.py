"""A Hugging Face safetensors export written by every rank, each its own share: no rank gathers
the model.

Callers: ``engine.export.stage`` (``HFExportStage.after_commit`` for ``SaveOptions(hf_export=
HFExport(...))``: into the checkpoint's ``huggingface/`` folder, after the commit: see below;
``run_export`` for ``unickpt.export_hf`` / ``Checkpointer.export_hf``: any folder), and
torchtitan's ``last_save_in_hf`` (``integrations.torchtitan``: the pieces of ``sd_adapter.to_hf``
of the sharded state dict).

Steps of ``export_pieces`` on every rank (* = collective, ``run_stage``: a failure anywhere is
the same error on every rank):
  describe*  each rank lists its pieces (output name, global shape, dtype, box, replica source,
             checkpoint key) and every rank receives every rank's list (one all_gather of a
             few ints per piece; in a save rank 0 adds the committed metadata's tensor order);
  assign     (pure, the same result on every rank: ``assign``) the tensor order, the files and
             their headers (``format.hf_layout.plan_layout``: the layout ``unickpt merge``
             writes), one writer per distinct box (its replica source, else the file's owner
             when it holds the box, else one of its holders), refused when the boxes of a tensor
             overlap or leave a gap;
  folder*    rank 0 creates the output folder (a link, a file, or a folder that is not empty
             is refused: nothing of anybody else is overwritten);
  create*    file ``i``'s owner (rank ``i % world``) creates ``<name>.unickpt-partial``
             (``O_EXCL | O_NOFOLLOW``), writes its header and sizes it;
  write*     every rank ``pwrite``s its boxes' bytes, cast to the export dtype, at the offsets
             ``format.hf_layout.box_runs`` gives (a dim-0 box is one run; a box split along a
             later dim one run per row), then ``fsync``s its writes;
  index*     rank 0 writes ``model.safetensors.index.json`` and copies ``config.json``, each
             under its temporary name (fsync), then (in a save) the complete record;
  publish*   each owner renames its files into place and syncs the folder;
  reveal*    rank 0 renames the index and ``config.json`` into place (folder sync): the index
             appears last.
In a save (``manifest_save_id`` given) rank 0 also writes the export's record
``unickpt.hf_export.json`` (``format.hf_manifest``): in ``folder`` before any file, naming them
all (``complete: false``), and again at the end of ``index``, every file written but none yet
under its final name, with their sizes (``complete: true``): what later deletes (a save
replacing this checkpoint, retention) may remove (``folder.hf_files``). No file takes its final
name while the record is incomplete, so an incomplete record proves only the temporaries
(``.unickpt-partial``) unickpt created; a file under a final name beside it (a user's
``config.json`` after an interrupted export) is never deleted.
A failure after ``create`` removes the partial files (each owner its own). Memory: each rank
holds at most one of its local boxes cast to the export dtype.

In a save (``SaveOptions.hf_export``; ``HFExportStage.check``: a folder holding files unickpt did
not write refuses the save before it starts) the export runs right after the commit, on the caller's
thread, and the call returns once every rank's HF files are durable and renamed (an async save
with ``hf_export`` therefore returns after its commit: meant for the last save of a run). After
the commit and not before because (1) the save refuses a folder holding files it did not write
(``folder.markers.check_save_folder``): exported files first would make every such save fail,
and (2) the committed checkpoint is the truth the HF files derive from: a failed export leaves
it whole, and ``unickpt merge`` of it writes the same files offline. A reader never sees a
partial HF file: each appears under its final name only once complete, the index last.

Storage: a path every rank sees through the local file system (a shared file system across
hosts); other storages (``s3://`` ...) are refused: export with ``unickpt merge`` from the
committed checkpoint instead. Every file is created, written, renamed, linked and removed
through ``storage.local_files``, relative to a descriptor of the output folder opened without
following a link (the rules of ``LocalStorage``): temporaries are created exclusively, a link in
the folder is never written through.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ...coordination import Coordinator, run_stage
from ...errors import ConfigurationError, PlanningError
from ...folder.target import prepare_output_folder
from ...format.hf_layout import (
    HF_FOLDER,
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    HFExport,
    HFLayout,
    box_runs,
    index_json,
    out_dtype,
    plan_layout,
)
from ...format.hf_manifest import MANIFEST_FILE, PARTIAL, HFManifest
from ...storage import local_files

__all__ = [
    "ExportPiece",
    "HFExportResult",
    "Assignment",
    "assign",
    "export_pieces",
    "export_state",
    "pieces_of_state",
    "pieces_of_tensors",
    "hf_folder",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True, eq=False)
class ExportPiece:
    """This rank's box ``offsets``/``lengths`` of output tensor ``name`` (global ``shape``);
    ``tensor`` holds exactly the box (shape == lengths, any strides, any device)."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    tensor: torch.Tensor
    replica_source: int | None = None
    source: str = ""  # the checkpoint key it was saved under ("" outside a save)


@dataclass(frozen=True, slots=True)
class HFExportResult:
    out: str
    files: tuple[str, ...]
    tensors: int
    bytes_written: int  # every file's size, headers included (all ranks together)
    seconds: float


@dataclass(frozen=True, slots=True)
class Assignment:
    """What ``assign`` decides (identical on every rank)."""

    layout: HFLayout
    writers: dict[tuple[str, Box], int]  # (name, box) -> the rank that writes it


def hf_folder(path: str, role: str | None = None) -> str:
    """The ``huggingface/`` folder of the checkpoint at the local ``path`` (``path/role``)."""
    local = _local_path(path)
    if role is not None:
        local = os.path.join(local, role)
    return os.path.join(local, HF_FOLDER)


def _local_path(path: str) -> str:
    text = str(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        raise ConfigurationError(
            f"Hugging Face export into {text}: only a local (or shared POSIX) path can be written by every rank; "
            "export the committed checkpoint with `unickpt merge` instead"
        )
    return os.path.abspath(os.path.expanduser(text))


def pieces_of_state(state: Mapping[str, Any], options: HFExport, framework: str = "auto") -> list[ExportPiece]:
    """The model's pieces of ``state`` as a save would name them (``model.<fqn>``), named
    without ``model.``, renamed by ``options.key_map`` (the names ``unickpt merge --model-only``
    writes). No collective."""
    from ...frameworks import get_framework
    from ...state.layout import StateLayout

    layout = StateLayout.of(state)
    adapter = get_framework(framework, layout.framework_state)
    view = adapter.save_view(layout.framework_state)
    out = []
    for item in view.items:
        spec = item.spec
        if not spec.fqn.startswith("model."):
            continue
        plain = spec.fqn[len("model.") :]
        name = options.key_map(plain) if options.key_map is not None else plain
        if name is None:
            continue
        out.append(
            ExportPiece(
                name,
                tuple(spec.global_shape),
                tuple(spec.offsets),
                tuple(spec.lengths),
                item.tensor,
                spec.replica_source,
                spec.fqn,
            )
        )
    return out


def pieces_of_tensors(tensors: Mapping[str, torch.Tensor]) -> list[ExportPiece]:
    """This rank's pieces of a name -> tensor mapping whose values are DTensors (each rank its
    local box) or plain tensors (every rank the whole tensor; one of them writes it). A DTensor
    whose local part is not one box (a strided shard, a partial sum) is made whole first
    (``full_tensor``, a collective decided by its placements alone, so every rank takes it)."""
    from ...frameworks._fsdp_internals import dtensor_local, dtensor_local_box

    out = []
    for name, value in tensors.items():
        t = value
        placements = getattr(t, "placements", None)
        if placements is not None and not all(_plain_placement(p) for p in placements):
            t = t.full_tensor()  # type: ignore[attr-defined]
            placements = None
        shape = tuple(int(n) for n in t.shape)
        if placements is None:
            out.append(ExportPiece(name, shape, (0,) * len(shape), shape, t.detach()))
            continue
        offsets, lengths = dtensor_local_box(t)
        out.append(ExportPiece(name, shape, tuple(offsets), tuple(lengths), dtensor_local(t).detach()))
    return out


def _plain_placement(p: Any) -> bool:
    """A ``Shard`` (not a strided one) or a ``Replicate`` placement: the local part is one box."""
    kind = type(p).__name__
    return kind in ("Shard", "Replicate")


def assign(
    described: Sequence[Sequence[Sequence[Any]]],
    world: int,
    cast: torch.dtype | None,
    max_shard_bytes: int,
    order: Sequence[str] = (),
) -> Assignment:
    """From every rank's ``(name, shape, dtype name, offsets, lengths, replica source, source
    key)`` lists: the layout and one writer per distinct box. Tensor order: that of their source
    keys in ``order`` (a committed checkpoint's tensor order, the order ``unickpt merge``
    writes), the others after them in order of first appearance (rank 0's first). Refuses a
    tensor whose ranks disagree on shape or dtype, whose boxes overlap without being equal, or
    that its boxes do not cover."""
    meta: dict[str, tuple[tuple[int, ...], str]] = {}
    holders: dict[str, dict[Box, list[int]]] = {}
    source: dict[tuple[str, Box], int] = {}
    key_of: dict[str, str] = {}
    for rank, pieces in enumerate(described):
        for name, shape_list, dtype, offsets_list, lengths_list, replica, key in pieces:
            key_of.setdefault(name, key)
            shape, offsets, lengths = tuple(shape_list), tuple(offsets_list), tuple(lengths_list)
            have = meta.setdefault(name, (shape, dtype))
            if have != (shape, dtype):
                raise PlanningError(
                    f"Hugging Face export: ranks disagree on {name!r}: shape {list(have[0])} {have[1]} "
                    f"and {list(shape)} {dtype} (rank {rank}); two tensors renamed onto one name?"
                )
            box = (offsets, lengths)
            holders.setdefault(name, {}).setdefault(box, []).append(rank)
            if replica is not None:
                source[(name, box)] = int(replica)
    position = {k: i for i, k in enumerate(order)}
    first = {name: i for i, name in enumerate(meta)}
    entries = []
    for name in sorted(meta, key=lambda n: (position.get(key_of[n], len(position)), first[n])):
        shape, dtype_name = meta[name]
        dtype = out_dtype(_dtype(dtype_name), cast)
        if dtype not in SAFETENSORS_DTYPES:
            raise ConfigurationError(
                f"Hugging Face export: {name!r} has dtype {dtype_name}, which safetensors cannot hold"
            )
        _check_cover(name, shape, list(holders[name]))
        entries.append((name, dtype, shape))
    layout = plan_layout(entries, max_shard_bytes)
    writers: dict[tuple[str, Box], int] = {}
    for i, f in enumerate(layout.files):
        owner = i % world
        for n, name in enumerate(f.tensors):
            for box, ranks in holders[name].items():
                src = source.get((name, box))
                if src is not None and src in ranks:
                    writers[(name, box)] = src
                elif owner in ranks:
                    writers[(name, box)] = owner
                else:
                    writers[(name, box)] = ranks[n % len(ranks)]
    return Assignment(layout, writers)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigurationError(f"Hugging Face export: unknown dtype {name!r}")
    return dtype


def _check_cover(name: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """The distinct boxes of ``name`` tile it exactly: pairwise disjoint, volumes summing to it."""
    nonempty = [b for b in boxes if all(n > 0 for n in b[1])]
    for i, (oa, la) in enumerate(nonempty):
        for ob, lb in nonempty[i + 1 :]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, la, ob, lb)):
                raise PlanningError(
                    f"Hugging Face export: {name!r} has overlapping boxes "
                    f"{list(oa)}+{list(la)} and {list(ob)}+{list(lb)}"
                )
    if sum(math.prod(b[1]) for b in nonempty) != math.prod(shape):
        raise PlanningError(f"Hugging Face export: the ranks' boxes of {name!r} do not cover its shape {list(shape)}")


def export_pieces(
    out: str,
    pieces: Sequence[ExportPiece],
    options: HFExport,
    coord: Coordinator,
    order: Sequence[str] = (),
    manifest_save_id: str | None = None,
) -> HFExportResult:
    """Write ``pieces`` (this rank's) as a Hugging Face folder ``out`` together with every rank
    of ``coord`` (module docstring). ``order``: the checkpoint's tensor order (``assign``; any
    one rank may give it). ``manifest_save_id``: not None in a save (every rank alike; the
    committed save id on rank 0): rank 0 records the files in ``unickpt.hf_export.json``.
    Collective; returns once every file is durable and named."""
    t0 = time.perf_counter()
    out = _local_path(out)
    rank, world = coord.rank, coord.world_size

    def describe() -> list[list[Any]]:
        seen: set[tuple[str, Box]] = set()
        mine = []
        for p in pieces:
            if tuple(p.tensor.shape) != tuple(p.lengths):
                raise ConfigurationError(f"Hugging Face export: {p.name!r}: local shape differs from its box")
            box = (tuple(p.offsets), tuple(p.lengths))
            if (p.name, box) in seen:
                raise ConfigurationError(f"Hugging Face export: two tensors are named {p.name!r}")
            seen.add((p.name, box))
            dtype = str(p.tensor.dtype).removeprefix("torch.")
            mine.append([p.name, list(p.shape), dtype, list(p.offsets), list(p.lengths), p.replica_source, p.source])
        return mine

    mine = run_stage(coord, "hf export (describe)", describe)
    everyone = [(mine, list(order))] if world == 1 else coord.all_gather_object((mine, list(order)))
    described = [d for d, _ in everyone]
    job_order = next((o for _, o in everyone if o), [])
    limit = options.max_shard_bytes
    plan = run_stage(coord, "hf export (assign)", lambda: assign(described, world, options.cast, limit, job_order))
    files = plan.layout.files
    owned = [i for i in range(len(files)) if i % world == rank]
    names = [f.name for f in files]
    if len(files) > 1 or options.always_index:
        names.append(INDEX_FILE)
    if options.config is not None:
        names.append("config.json")
    record = None if manifest_save_id is None else HFManifest(manifest_save_id, False, tuple((n, None) for n in names))

    def folder() -> None:
        if rank != 0:
            return
        prepare_output_folder(out, "Hugging Face export", refuse_linked_parent=True)
        if record is not None:  # before any export file: every one of them is named as unickpt's
            with _folder(out) as dfd:
                _write_atomically(dfd, MANIFEST_FILE, record.encode(), replace=False)

    run_stage(coord, "hf export (folder)", folder)
    created: list[str] = []  # this rank's temporaries, removed on a failure
    later: list[str] = []  # rank 0: the index and config.json, renamed after every shard
    try:
        run_stage(coord, "hf export (create)", lambda: _create(out, [files[i] for i in owned], created))
        run_stage(coord, "hf export (write)", lambda: _write(out, plan, pieces, rank, options.cast))
        run_stage(
            coord, "hf export (index)", lambda: _index(out, plan.layout, options, record, later) if rank == 0 else None
        )
        run_stage(coord, "hf export (publish)", lambda: _publish(out, created))
        created.clear()
        run_stage(coord, "hf export (reveal)", lambda: _publish(out, later))
        later.clear()
    except BaseException:
        if created or later:
            with _folder(out) as dfd:
                for tmp in created + later:
                    local_files.unlink_at(dfd, tmp, missing_ok=True)
        raise
    total = sum(f.size for f in files)
    return HFExportResult(out, tuple(names), len(plan.layout.where()), total, time.perf_counter() - t0)


@contextmanager
def _folder(out: str) -> Iterator[int]:
    """A descriptor of the export folder ``out``, opened without following a link at ``out``."""
    with local_files.open_dir(os.path.dirname(out), [os.path.basename(out)], create=False) as dfd:
        yield dfd


def _create(out: str, files: Sequence[Any], created: list[str]) -> None:
    """This rank's files under their temporary names (exclusive), each holding its header and
    sized; their names are appended to ``created`` (removed on a failure)."""
    with _folder(out) as dfd:
        for f in files:
            tmp = f.name + PARTIAL
            fd = local_files.create_at(dfd, tmp)
            created.append(tmp)
            try:
                local_files.pwrite_all(fd, memoryview(f.header), 0)
                local_files.truncate(fd, f.size)
            finally:
                os.close(fd)


def _write(out: str, plan: Assignment, pieces: Sequence[ExportPiece], rank: int, cast: torch.dtype | None) -> None:
    """This rank's boxes into the temporaries (created by their owners), then fsync."""
    where = plan.layout.where()
    fds: dict[int, int] = {}
    with _folder(out) as dfd:
        try:
            for p in pieces:
                box = (tuple(p.offsets), tuple(p.lengths))
                if plan.writers.get((p.name, box)) != rank or math.prod(p.lengths) == 0:
                    continue
                file_index, start = where[p.name]
                if file_index not in fds:
                    tmp = plan.layout.files[file_index].name + PARTIAL
                    fds[file_index] = local_files.open_file_at(dfd, tmp, os.O_WRONLY, path=os.path.join(out, tmp))
                fd = fds[file_index]
                local = p.tensor.detach().to("cpu", out_dtype(p.tensor.dtype, cast)).contiguous()
                data = memoryview(local.reshape(-1).view(torch.uint8).numpy().data).cast("B")
                at = 0
                for off, n in box_runs(p.shape, p.offsets, p.lengths, local.element_size()):
                    local_files.pwrite_all(fd, data[at : at + n], start + off)
                    at += n
                del local, data
            for fd in fds.values():
                local_files.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)


def _publish(out: str, created: list[str]) -> None:
    """Rename the temporaries ``created`` to their final names, then sync the folder."""
    if not created:
        return
    with _folder(out) as dfd:
        for tmp in created:
            local_files.rename_at(dfd, tmp, dfd, tmp[: -len(PARTIAL)])
        local_files.sync_folder(dfd)


def _index(out: str, layout: HFLayout, options: HFExport, record: HFManifest | None, temps: list[str]) -> None:
    """Rank 0, after every shard is written (under its temporary name): the index and
    ``config.json`` under their temporary names (appended to ``temps``: ``reveal`` renames
    them), then (``record``) the complete manifest with every size, durable before any file
    takes its final name."""
    sizes = {f.name: f.size for f in layout.files}
    with _folder(out) as dfd:
        if len(layout.files) > 1 or options.always_index:
            data = index_json(layout)
            temps.append(_write_temporary(dfd, INDEX_FILE, data))
            sizes[INDEX_FILE] = len(data)
        if options.config is not None:
            if not os.path.isfile(options.config):
                raise ConfigurationError(f"Hugging Face export: config {options.config} is not a file")
            tmp = "config.json" + PARTIAL
            fd = local_files.create_at(dfd, tmp)
            temps.append(tmp)
            try:
                with open(options.config, "rb") as src:
                    while chunk := src.read(1 << 20):
                        local_files.write_all(fd, [memoryview(chunk)])
                local_files.fsync(fd)
                sizes["config.json"] = os.fstat(fd).st_size
            finally:
                os.close(fd)
        if record is not None:
            done = HFManifest(record.save_id, True, tuple((n, sizes[n]) for n, _ in record.files))
            _write_atomically(dfd, MANIFEST_FILE, done.encode())
            local_files.sync_folder(dfd)


def _write_temporary(dfd: int, final: str, data: bytes) -> str:
    """``data`` into ``final``'s temporary in the folder ``dfd`` (exclusive, no link followed,
    fsync); returns the temporary's name."""
    tmp = final + PARTIAL
    fd = local_files.create_at(dfd, tmp)
    try:
        local_files.pwrite_all(fd, memoryview(data), 0)
        local_files.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def _write_atomically(dfd: int, final: str, data: bytes, replace: bool = True) -> None:
    """``data`` into ``final`` in the folder ``dfd`` through a temporary (exclusive, fsync,
    rename); ``replace=False``: an existing ``final`` is refused (hard-linked into place, then
    the temporary unlinked)."""
    tmp = _write_temporary(dfd, final, data)
    if replace:
        local_files.rename_at(dfd, tmp, dfd, final)
        return
    try:
        local_files.link_at(dfd, tmp, dfd, final)
    finally:
        local_files.unlink_at(dfd, tmp)


def export_state(
    out: str,
    state: MutableMapping[str, Any],
    options: HFExport,
    coord: Coordinator,
    framework: str = "auto",
    order: Sequence[str] = (),
    manifest_save_id: str | None = None,
) -> HFExportResult:
    """``export_pieces`` of the model in ``state`` (``pieces_of_state``); collective."""
    pieces = run_stage(coord, "hf export (state)", lambda: pieces_of_state(state, options, framework))
    return export_pieces(out, pieces, options, coord, order, manifest_save_id)
