"""The load planner (pure; no I/O, no collectives). In the order a load uses it:

``targets``  what a load asks of the metadata (keys, shapes, dtypes), checked before any read;
``overlap``  which saved shards one rank needs and which sub-boxes go where (``plan_local_load``,
             with ``shards.ShardIndex``, the overlap index);
``assign``   who reads which shard a job needs (``assign_reads``, at the coordinator; the rule
             written plainly beside it; its columnar implementation in ``_columns`` over
             ``shards.ShardLookup``);
``runs``     which bytes a rank reads, where they land (direct, forwarded, small) and the runs
             they are read in.

``engine.load`` executes the plan: the exchange of needs and parts, the reads, the forwarding.
"""

from .assign import ReadBatch, ReadPart, ShardKey, assign_reads
from .overlap import CopyOp, ShardRead, plan_local_load
from .shards import ShardIndex
from .targets import KeyReport, check_targets, keys_error

__all__ = [
    "ReadBatch",
    "ReadPart",
    "ShardKey",
    "assign_reads",
    "CopyOp",
    "ShardRead",
    "plan_local_load",
    "ShardIndex",
    "KeyReport",
    "check_targets",
    "keys_error",
]
