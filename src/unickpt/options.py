"""The options of a save (``SaveOptions``) and of a load (``LoadOptions``, grouped: ``io`` =
``ReadOptions``, ``limits`` = ``LoadLimits``, ``restore`` = ``RestoreOptions``): small frozen,
keyword-only dataclasses that validate their values when built. The caller builds them; the
save and load pipelines (``engine.save``, ``engine.load``) only read them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .coordination.topology import CoordinationOptions
from .format.checksums import MAX_CHUNK, MIN_CHUNK, is_chunk_size
from .format.hf_layout import HFExport
from .format.transforms import RowsTensor
from .storage.base import METADATA_LIMIT
from .storage.options import StorageOptions

__all__ = [
    "SaveOptions",
    "LoadOptions",
    "ReadOptions",
    "LoadLimits",
    "RestoreOptions",
    "HFExport",
    "StorageOptions",
    "CoordinationOptions",
    "ExtraStateOnResize",
    "LoaderOnResize",
]


class ExtraStateOnResize(StrEnum):
    """``RestoreOptions.extra_state_on_resize``: per-rank extra_state (RNG states, per-rank counters)
    after a change of world size. The plain strings are accepted too (and compare equal)."""

    MODULO = "modulo"  # rank r gets saved rank r % saved_world_size's values (a warning after growing)
    RANK0 = "rank0"  # every rank gets saved rank 0's
    ERROR = "error"  # ExtraStateResizeError
    SKIP = "skip"  # extra_state is left as the job built it, with a warning


class LoaderOnResize(StrEnum):
    """``RestoreOptions.loader_on_resize``: a loader without the unickpt.data protocol (per-rank
    state_dict) after a change of world size. The plain strings are accepted too."""

    ERROR = "error"  # LoaderStateError: its state cannot be split or merged
    SKIP = "skip"  # leave the loader as it is, with a warning


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveOptions:
    files_per_rank: int = 2  # data files per rank, written by parallel workers
    io_threads: int = 4  # writer threads per rank
    cleanup_previous: bool = True  # delete the previous checkpoint's data at this path after commit
    # async saves: copy the optimizer's parameters and state on a background thread after the call
    # returns; the optimizer's next step() waits for that copy. Turn off when the loop changes
    # them in place outside optimizer.step() right after saving (or call handle.wait_snapshot()).
    background_snapshot: bool = True
    # the save lock's lease: rank 0 renews it every lease/6 s while the save runs; a lock not
    # renewed for this long is stale on any host (its job is gone or frozen) and may be broken
    lock_lease_s: float = 60.0
    # seconds each collective of this save (planning, commit) may wait for the other ranks before
    # failing with CollectiveTimeoutError naming the ranks that did not arrive; None: the job's
    # timeout (init_process_group(timeout=...))
    timeout: float | None = None
    # how the storage is opened: retry policy, local direct writes/reads (storage.StorageOptions)
    storage: StorageOptions = field(default_factory=StorageOptions)
    # every data file is checksummed (CRC32C) per chunk of this many bytes (format.checksums): a
    # load reads and verifies whole chunks, so at most one chunk more than it needs at each end of
    # a range; the metadata holds 4 bytes per chunk. None: 1 MiB, doubled for checkpoints over
    # 2 TiB so that the metadata holds at most 2 Mi checksums (format.checksums.auto_chunk); the
    # save's coordinator decides, and every rank writes with its choice
    checksum_chunk_bytes: int | None = None
    # keep every rank's phase records of this save (plan, stage, write, barrier, ...: a few
    # hundred bytes a rank) inside the checkpoint, data/<save_id>/phases.json, for
    # `unickpt report CKPT` (monitoring.phases); False: none are kept
    record_phases: bool = True
    # pause Python's cyclic garbage collector while this call builds its per-tensor records (a
    # blocking save: to the end of its commit; an async save: until the call returns, never during
    # its background write and commit): with ~10^5 tensors it saves full collections that find
    # nothing (engine.gc_pause). False: the collector is left alone
    pause_gc: bool = True
    # a Hugging Face safetensors export of the model (format.hf_layout.HFExport: dtype, shard size,
    # config.json, renames) into the checkpoint's huggingface/ folder, every rank writing its own
    # share (engine.export.hf), right after the commit; the call (async too) returns once those
    # files are durable. Local (or shared POSIX) paths only. None: no export
    hf_export: HFExport | None = None
    # who writes an async save's files: "threads" (writer threads in this process) or "process"
    # (a writer process per checkpointer, fed the snapshot through shared memory, so writing and
    # checksumming never compete with training for this interpreter; Linux, local files and CPU
    # snapshots only, else threads). Blocking saves always write from the live tensors in
    # threads. Measured in docs/performance.md ("Training during a background save")
    writer: str = "threads"

    def __post_init__(self) -> None:
        _check_timeout(self.timeout)
        if self.writer not in ("threads", "process"):
            raise ValueError(f"SaveOptions.writer must be 'threads' or 'process', got {self.writer!r}")
        chunk = self.checksum_chunk_bytes
        if chunk is not None and not is_chunk_size(chunk):
            raise ValueError(
                f"checksum_chunk_bytes must be None or an int in [{MIN_CHUNK}, {MAX_CHUNK}], got {chunk!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadOptions:
    """``LoadOptions.io``: how a load reads the checkpoint's bytes. These change how fast a load
    is, never what it loads."""

    threads: int = 4  # reader threads per rank
    # read each saved byte once across all ranks and forward it over the process group:
    # True always, False never, None (auto) unless all ranks share one host's page cache
    dedup_reads: bool | None = None
    # loads onto CUDA tensors: read through reusable pinned host buffers, host-to-device copies on a
    # side stream overlapped with the reads (engine.load.device). Off by default until bench/gpu_check.sh
    # has run it on a GPU; off: each piece read into host memory and copied with a blocking copy
    pinned_device_copies: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadLimits:
    """``LoadOptions.limits``: caps on what a checkpoint's content makes unickpt read or allocate
    (SizeLimitError beyond), so that a hostile or corrupt checkpoint cannot exhaust memory."""

    max_metadata_bytes: int = METADATA_LIMIT  # the metadata file (1 GiB)
    max_blob_bytes: int = 1 << 30  # each extra_state / dataloader blob


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreOptions:
    """``LoadOptions.restore``: how the saved state maps onto the job's when they differ (names,
    tensor layout, dtypes, world size)."""

    # rename checkpoint keys as they are read: key_map("model.transformer.h.0.attn.weight") ->
    # "model.layers.0.attn.weight" (None drops the tensor); optimizer keys and param groups follow
    # (format.keymap). For loading into a model whose names differ (HF <-> Megatron names ...)
    key_map: Callable[[str], str | None] | None = None
    # tensors derived from saved ones as they are read, after key_map (format.transforms):
    # row ranges joined along dim 0, e.g. a fused QKV split into Q, K, V
    # (transforms.split_rows / megatron_qkv_split) or Q, K, V fused; optimizer state follows
    transforms: Sequence[RowsTensor] = ()
    # convert each tensor to the destination's dtype while loading (as Tensor.to); False: a dtype
    # that differs is a DtypeMismatchError
    cast_dtypes: bool = False
    # per-rank extra_state (RNG states, per-rank counters) after a change of world size:
    # "modulo" (rank r gets saved rank r % saved_world_size's values: after growing, several ranks
    # get one saved rank's RNG state; a warning says so), "rank0" (every rank gets saved rank 0's),
    # "error" (ExtraStateResizeError), "skip" (extra_state is left
    # as the job built it, with a warning); an ExtraStateOnResize or its string
    extra_state_on_resize: ExtraStateOnResize | str = ExtraStateOnResize.MODULO
    # a loader without the unickpt.data protocol (per-rank state_dict) after a change of world
    # size: "error" (LoaderStateError: its state cannot be split or merged) or "skip" (leave
    # the loader as it is, with a warning); a LoaderOnResize or its string
    loader_on_resize: LoaderOnResize | str = LoaderOnResize.ERROR
    # a plain tensor of the job (a module's parameter or buffer that is no DTensor, a FlatTensors
    # entry) whose saved shape differs from its live one (a buffer the model grows as it trains)
    # takes the saved tensor: a module gets it through its own load_state_dict, as PyTorch's and
    # Hugging Face's loads hand a model every saved tensor (a module that does not resize there
    # raises ResizeRefusedError), once the data files were checked to hold all its bytes
    # (engine.load.resize). False: a shape that differs is a ShapeMismatchError. Sharded tensors
    # (DTensors) and optimizer state always raise it
    resize_plain_tensors: bool = False

    def __post_init__(self) -> None:
        extra = _member(ExtraStateOnResize, self.extra_state_on_resize)
        if extra is None:
            raise ValueError(
                f"extra_state_on_resize must be modulo, rank0, error or skip, got {self.extra_state_on_resize!r}"
            )
        loader = _member(LoaderOnResize, self.loader_on_resize)
        if loader is None:
            raise ValueError(f"loader_on_resize must be 'error' or 'skip', got {self.loader_on_resize!r}")
        object.__setattr__(self, "extra_state_on_resize", extra)  # the member, whichever form was given
        object.__setattr__(self, "loader_on_resize", loader)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOptions:
    """How one load runs: ``io`` (reads), ``limits`` (caps), ``restore`` (mapping saved state
    onto the job's), and the load's checks, deadline, storage and collector.

    Change one setting of a group with ``dataclasses.replace``, e.g.
    ``replace(opts, io=replace(opts.io, threads=8))``."""

    io: ReadOptions = field(default_factory=ReadOptions)
    limits: LoadLimits = field(default_factory=LoadLimits)
    restore: RestoreOptions = field(default_factory=RestoreOptions)
    verify_checksums: bool = True  # verify each chunk read against its CRC32C (ChecksumMismatchError)
    # read every tensor's bytes into staging buffers and verify them all before copying any into
    # the job's tensors (a failed load leaves them untouched, at the cost of one copy's memory);
    # False: bytes go straight into the tensors, so a failure mid-way leaves them partly loaded
    stage_before_apply: bool = False
    # seconds each collective of this load may wait for the other ranks (see SaveOptions.timeout)
    timeout: float | None = None
    # how the storage is opened (see SaveOptions.storage)
    storage: StorageOptions = field(default_factory=StorageOptions)
    # pause Python's cyclic garbage collector during the load's validation, reads and apply
    # (see SaveOptions.pause_gc); False: the collector is left alone
    pause_gc: bool = True

    def __post_init__(self) -> None:
        for name, kind in _GROUPS.items():
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(f"LoadOptions.{name} must be a {kind.__name__}, got {value!r}")
        _check_timeout(self.timeout)


_GROUPS: dict[str, type[Any]] = {"io": ReadOptions, "limits": LoadLimits, "restore": RestoreOptions}


def _member(enum: type[StrEnum], value: object) -> StrEnum | None:
    """The member of ``enum`` that ``value`` is or names (a str exactly as the member's value), else None."""
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        try:
            return enum(value)
        except ValueError:
            return None
    return None


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
