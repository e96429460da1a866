"""Save planning: local plans from every rank -> one global plan (pure functions).

Runs on the coordinator (rank 0) in the plan stage (``engine.plan_cache``), after the gather of
the ranks' ``LocalSavePlan``s; the result is scattered back as ``RankSavePlan``s and reused (cached)
while the local plans do not change. The rules, each written once:
1. the ranks agree on each tensor's dtype and global shape (``rows.JobRows.disagreements``);
2. identical boxes on several ranks are replicas, each written once: by the replica a holder's
   spec names as ``replica_source`` (e.g. DDP buffers: rank 0 of the DDP group), else by the
   replica with the fewest bytes assigned so far (worst-fit, largest boxes first):
   ``writers.choose_writers``;
3. the written boxes of each tensor neither overlap nor leave gaps (``rows.tiling_problems``,
   ``format.validation.box_coverage_problem``: the decoder's check);
4. split tensors: tensors every rank holds one ``torch.chunk`` part of (``split.chunk_dims``;
   FSDP over the whole job) are laid out alike in every rank's files and recorded as layouts,
   so the metadata describes each once (``split.split_parts``);
5. each rank's entries go into ``files_per_rank`` files, its split chunks first, then the rest
   largest first to the lightest file, each at a multiple of ENTRY_ALIGN bytes
   (``layout.lay_out_rank``), self-checked with ``format.validation.overlap_problems``.
``plan_save`` takes the ranks' ``ShardTable``s (the coordinator decodes them as the planner asks:
``wire.LocalPlans``) and groups ranks by equal tables: first ``templates.plan_regular``, which
reads one rank's table at a time, reduces each to a template (its table modulo the chunk rule:
an FSDP job of 4,096 ranks is one template, a DDP job too), applies rules 1-5 to the templates'
rows (rule 4's retry with fewer split tensors, then none, included) and returns rank plans
computed when asked (``RegularRankPlans``: the coordinator never holds every rank's entries);
for any other job (more than ``templates.MAX_TEMPLATES`` templates, a tensor the chunk rule
splits on some ranks only that the columns might split, or a refusal: ``templates.NotRegular``,
which never leaves this module) ``columns.plan_tables`` applies the same rules to one group per
rank, returns every rank's plan and words the refusals rank by rank. Every refusal raises
(``PlanningError``). The plain per-record statement of these rules is the tests' oracle
(tests/support/save_oracle.py), which both paths are property-tested against.
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
    ``wire.LocalPlans``, which decodes the gathered bytes when a table is asked for): on
    templates of ranks (``templates.plan_regular``) where they fit, else on one group per rank
    (``columns.plan_tables``, which raises ``PlanningError`` for a job that cannot be saved)."""
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
