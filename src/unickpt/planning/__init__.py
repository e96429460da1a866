"""Pure planning functions: shard specs -> save plan, specs + metadata -> load plan.

No I/O and no collectives, so every rule is tested in one process: ``specs`` (the shard spec
adapters produce), ``boxes`` (N-D box geometry both sides share), ``save`` (every rank's local
plan -> one global plan), ``load`` (what each rank reads and where it lands), ``objects`` (the
ranks' JSON objects merged at commit). ``engine`` executes what these return.

The names below are imported from their modules on first access (``__getattr__``), so that a
torch-free module (``boxes``, ``load.shards`` ...) imports without ``specs`` (torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
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

_LAZY = {
    **dict.fromkeys(("FlatPiece", "decompose_flat_range", "intersect", "numel"), ".boxes"),
    **dict.fromkeys(("CopyOp", "KeyReport", "ShardRead", "check_targets", "plan_local_load"), ".load"),
    **dict.fromkeys(("GlobalSavePlan", "LocalSavePlan", "RankSavePlan", "WriteEntry", "plan_save"), ".save"),
    **dict.fromkeys(("BlobSpec", "LoadItem", "SaveItem", "ShardSpec"), ".specs"),
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
