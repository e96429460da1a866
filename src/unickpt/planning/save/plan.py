"""Save planning: local plans from every rank -> one global plan (pure functions).

Runs on the coordinator (rank 0) in the plan stage (``engine.plan_cache``), after the gather of
the ranks' ``LocalSavePlan``s; the result is scattered back as ``RankSavePlan``s and reused (cached)
while the local plans do not change. Steps:
1. check every rank agrees on each tensor's dtype and global shape;
2. deduplicate: identical boxes on several ranks are replicas; each is written once: by the
   replica a holder's spec names as ``replica_source`` (the copy the framework treats as
   authoritative, e.g. DDP buffers: rank 0 of the DDP group), else by the replica with the
   fewest bytes assigned so far (worst-fit, largest boxes first);
3. check the written boxes of each tensor neither overlap nor leave gaps
   (``format.validation.box_coverage_problem``, the same check the metadata decoder runs);
4. lay out bytes: each rank's items go into ``files_per_rank`` files, balanced by bytes, each
   entry starting at a multiple of ENTRY_ALIGN bytes; self-check that no two entries of a file
   overlap (``format.validation.overlap_problems``, again the decoder's check), so a plan that
   passes here decodes;
5. split tensors: tensors every rank holds one chunk of (FSDP over the whole job) are laid
   out alike in every rank's files and recorded as layouts, so the metadata describes each
   once (decided with step 4: ``split``'s rules, which both paths use).
``plan_save`` takes the ranks' ``ShardTable``s (the coordinator decodes them as the planner
asks: ``wire.LocalPlans``) and runs these steps on templates of ranks (``templates``) or on
columns (``columns``), with the rules of ``writers`` (step 2) and ``layout`` (step 4) written
once. Every refusal raises (``PlanningError``). The plain per-record statement of these steps is
the tests' oracle (tests/support/save_oracle.py), which both paths are property-tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import PlanningError
from .columns import plan_tables
from .model import GlobalSavePlan, LocalSavePlan
from .table import ShardTable
from .templates import NotRegular, plan_regular

__all__ = ["plan_save"]


def plan_save(
    local_plans: Sequence[LocalSavePlan | ShardTable], save_id: str, files_per_rank: int = 1
) -> GlobalSavePlan:
    """The global plan of every rank's local plan (records or tables: the coordinator passes
    ``wire.LocalPlans``, which decodes the gathered bytes when a table is asked for). Regular
    jobs are planned on templates of ranks (``templates.plan_regular``, which reads one rank's
    table at a time); every other job on columns (``columns.plan_tables``, which raises
    ``PlanningError`` for a job that cannot be saved, and lays out split tensors itself)."""
    world = len(local_plans)
    if files_per_rank < 1:
        raise PlanningError("files_per_rank must be >= 1")
    try:
        return plan_regular(local_plans, save_id, files_per_rank)
    except NotRegular:
        pass  # not a template job: columns
    tables = [p if isinstance(p, ShardTable) else ShardTable.of(p) for p in local_plans]
    if [t.rank for t in tables] != list(range(world)):
        raise PlanningError("local plans must come from ranks 0..world_size-1 in order")
    return plan_tables(tables, save_id, files_per_rank)
