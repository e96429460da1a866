"""unickpt: unified checkpointing for large-model training in PyTorch.

handle = unickpt.save("ckpts/step_100", {"model": m, "optimizer": opt,
                      "extra_state": {"step": 100, "rng": unickpt.rng_state()}}, framework="fsdp2")
unickpt.load("ckpts/step_100", state, framework="auto")   # any world size / parallelism
"""

from . import data  # the unickpt.data protocol; registers the "dataloader" metadata section
from .api import SaveHandle, export_hf, load, save, wait_all
from .checkpointer import Checkpointer, default_checkpointer
from .errors import (
    AsyncSaveFailures,
    CheckpointError,
    ChecksumMismatchError,
    CollectiveError,
    CollectiveTimeoutError,
    ConcurrentSaveError,
    CorruptMetadataError,
    DtypeMismatchError,
    ExtraStateResizeError,
    ForeignFolderError,
    FrameworkError,
    IncompleteCheckpointError,
    LoaderStateError,
    MissingDataFileError,
    MissingDependencyError,
    MissingKeysError,
    NoProcessGroupError,
    NotACheckpointError,
    PlanningError,
    RankDisagreementError,
    RankFailures,
    RemoteRankError,
    SaveLockLostError,
    ShapeMismatchError,
    SizeLimitError,
    SnapshotConflictError,
    StorageError,
    TransientStorageError,
    TruncatedDataFileError,
    UnexpectedKeysError,
    UnsafeNameError,
    UnsafePathError,
    UnsupportedFormatVersionError,
    UnsupportedValueError,
)
from .format import transforms  # LoadOptions(transforms=...): split_rows, megatron_qkv_split ...
from .frameworks.flat import FlatTensors
from .manager import CheckpointManager
from .options import CoordinationOptions, HFExport, LoadOptions, SaveOptions, StorageOptions
from .state.extra import rng_state, set_rng_state
from .state.items import PerRank
from .tiering import TieredCheckpointManager

__version__ = "0.1.0"

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
]
