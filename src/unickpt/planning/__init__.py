"""Pure planning functions: shard specs -> save plan, specs + metadata -> load plan."""

from .boxes import FlatPiece, decompose_flat_range, intersect, numel
from .load import CopyOp, KeyReport, ShardRead, check_targets, plan_local_load
from .save import GlobalSavePlan, LocalSavePlan, RankSavePlan, WriteEntry, plan_save
from .specs import BlobSpec, LoadItem, SaveItem, ShardSpec

__all__ = [
    "FlatPiece",
    "decompose_flat_range",
    "intersect",
    "numel",
    "CopyOp",
    "KeyReport",
    "ShardRead",
    "check_targets",
    "plan_local_load",
    "GlobalSavePlan",
    "LocalSavePlan",
    "RankSavePlan",
    "WriteEntry",
    "plan_save",
    "BlobSpec",
    "LoadItem",
    "SaveItem",
    "ShardSpec",
]
