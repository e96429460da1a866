"""unickpt: unified checkpointing for large-model training in PyTorch.

handle = unickpt.save("ckpts/step_100", {"model": m, "optimizer": opt,
                      "extra_state": {"step": 100, "rng": unickpt.rng_state()}}, framework="fsdp2")
unickpt.load("ckpts/step_100", state, framework="auto")   # any world size / parallelism

Importing ``unickpt`` is cheap: it does not import torch. Each public name is imported from its
module on first access (PEP 562 ``__getattr__`` below, table ``_LAZY``), so the command line's
metadata commands (``unickpt ls``, ``latest``, ``prune``, ``inspect``) and ``--help`` never pay
for torch, ``torch.distributed.tensor`` or sympy; ``unickpt.save`` pays for them once, on first
use. A process that has imported torch before ``import unickpt`` (a training job; the metadata
commands never import torch) imports the save and load machinery (``unickpt.api``) right away
instead (``_preload``): its start-up pays that once, with its other imports, and its first
``unickpt.load`` (a restart's critical path) pays none of it. ``from unickpt import X``,
``unickpt.X`` and ``dir(unickpt)`` work for every name in ``__all__``; type checkers read the ``TYPE_CHECKING`` imports.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ._lazy import lazy_exports

# torch-free and registers the "dataloader" metadata section, so that decoding the metadata of a
# checkpoint that holds one never depends on whether ``unickpt.data`` was imported yet
from .state import loader as _loader  # noqa: F401

if TYPE_CHECKING:
    from . import data
    from .api import SaveHandle, export_hf, load, save, wait_all
    from .checkpointer import Checkpointer, default_checkpointer
    from .errors import (
        AsyncSaveFailures,
        CheckpointError,
        ChecksumMismatchError,
        CollectiveError,
        CollectiveTimeoutError,
        ConcurrencyError,
        ConcurrentSaveError,
        ConfigurationError,
        CoordinationError,
        CorruptMetadataError,
        DtypeMismatchError,
        ExtraStateResizeError,
        ForeignFolderError,
        FrameworkError,
        IncompleteCheckpointError,
        IntegrityError,
        InternalError,
        LoaderStateError,
        MissingDataFileError,
        MissingDependencyError,
        MissingKeysError,
        NoProcessGroupError,
        NotACheckpointError,
        OutputInsideSourceError,
        PlanningError,
        RankDisagreementError,
        RankFailures,
        RemoteRankError,
        ResizeRefusedError,
        SaveLockLostError,
        ShapeMismatchError,
        SizeLimitError,
        SnapshotConflictError,
        StatefulListMismatchError,
        StateMismatchError,
        StorageError,
        TransientStorageError,
        TruncatedDataFileError,
        UnexpectedKeysError,
        UnsafeNameError,
        UnsafePathError,
        UnsupportedFormatVersionError,
        UnsupportedValueError,
        WriterProcessError,
    )
    from .format import transforms
    from .frameworks.flat import FlatTensors
    from .manager import CheckpointManager
    from .options import CoordinationOptions, HFExport, LoadOptions, SaveOptions, StorageOptions
    from .state.extra import rng_state, set_rng_state
    from .state.items import PerRank
    from .tiering import TieredCheckpointManager

__version__ = "0.1.0"

# public name -> (module relative to this package, attribute; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "data": (".data", None),  # the unickpt.data protocol
    "transforms": (".format.transforms", None),  # LoadOptions(transforms=...): split_rows, megatron_qkv_split ...
    **{name: (".api", name) for name in ("SaveHandle", "export_hf", "load", "save", "wait_all")},
    **{name: (".checkpointer", name) for name in ("Checkpointer", "default_checkpointer")},
    **{
        name: (".errors", name)
        for name in (
            "AsyncSaveFailures",
            "CheckpointError",
            "ChecksumMismatchError",
            "CollectiveError",
            "CollectiveTimeoutError",
            "ConcurrencyError",
            "ConcurrentSaveError",
            "ConfigurationError",
            "CoordinationError",
            "CorruptMetadataError",
            "DtypeMismatchError",
            "ExtraStateResizeError",
            "ForeignFolderError",
            "FrameworkError",
            "IncompleteCheckpointError",
            "IntegrityError",
            "InternalError",
            "LoaderStateError",
            "MissingDataFileError",
            "MissingDependencyError",
            "MissingKeysError",
            "NoProcessGroupError",
            "NotACheckpointError",
            "OutputInsideSourceError",
            "PlanningError",
            "RankDisagreementError",
            "RankFailures",
            "RemoteRankError",
            "ResizeRefusedError",
            "SaveLockLostError",
            "ShapeMismatchError",
            "SizeLimitError",
            "SnapshotConflictError",
            "StateMismatchError",
            "StatefulListMismatchError",
            "StorageError",
            "TransientStorageError",
            "TruncatedDataFileError",
            "UnexpectedKeysError",
            "UnsafeNameError",
            "UnsafePathError",
            "UnsupportedFormatVersionError",
            "UnsupportedValueError",
            "WriterProcessError",
        )
    },
    "FlatTensors": (".frameworks.flat", "FlatTensors"),
    "CheckpointManager": (".manager", "CheckpointManager"),
    **{
        name: (".options", name)
        for name in ("CoordinationOptions", "HFExport", "LoadOptions", "SaveOptions", "StorageOptions")
    },
    **{name: (".state.extra", name) for name in ("rng_state", "set_rng_state")},
    "PerRank": (".state.items", "PerRank"),
    "TieredCheckpointManager": (".tiering", "TieredCheckpointManager"),
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


def _preload() -> None:
    """In a process that has imported torch: import what ``save`` and ``load`` run (the public
    names stay lazy: bound on first access). The command line never imports torch first, so its
    metadata commands stay instant; a job pays for these modules here, once, not in its first
    load (bench/cold_load_phases.py --no-preimport, docs/performance.md)."""
    from . import api  # noqa: F401  # checkpointer -> the load and save pipelines, frameworks, storage
    from .coordination import tree  # noqa: F401  # the first load's coordinator on large jobs
    from .format import checksums

    checksums.preload()  # awscrt, imported by the first checksum otherwise


if "torch" in sys.modules:
    _preload()


__all__ = [
    "transforms",
    "save",
    "load",
    "wait_all",
    "export_hf",
    "HFExport",
    "Checkpointer",
    "default_checkpointer",
    "SaveHandle",
    "SaveOptions",
    "LoadOptions",
    "StorageOptions",
    "CoordinationOptions",
    "rng_state",
    "set_rng_state",
    "PerRank",
    "CheckpointError",
    "ChecksumMismatchError",
    "ConcurrentSaveError",
    "CorruptMetadataError",
    "DtypeMismatchError",
    "FrameworkError",
    "IncompleteCheckpointError",
    "MissingDataFileError",
    "MissingKeysError",
    "NotACheckpointError",
    "NoProcessGroupError",
    "UnsafeNameError",
    "PlanningError",
    "LoaderStateError",
    "ExtraStateResizeError",
    "RankFailures",
    "ShapeMismatchError",
    "SnapshotConflictError",
    "StorageError",
    "TruncatedDataFileError",
    "UnexpectedKeysError",
    "UnsupportedFormatVersionError",
    "CheckpointManager",
    "TieredCheckpointManager",
    "FlatTensors",
    "data",
    "TransientStorageError",
    "UnsupportedValueError",
    "RankDisagreementError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "RemoteRankError",
    "AsyncSaveFailures",
    "SaveLockLostError",
    "ForeignFolderError",
    "UnsafePathError",
    "SizeLimitError",
    "MissingDependencyError",
    "IntegrityError",
    "StateMismatchError",
    "CoordinationError",
    "ConcurrencyError",
    "ConfigurationError",
    "InternalError",
    "WriterProcessError",
    "ResizeRefusedError",
    "StatefulListMismatchError",
    "OutputInsideSourceError",
]
