"""The save planner: every rank's local plan -> one global plan (pure functions).

``model`` holds the records; ``table`` a rank's shards as columns; ``plan.plan_save`` is the
planner, on groups of ranks (``templates``; the coordinator calls it from ``engine.plan_cache``);
``wire`` encodes and decodes the plans that travel between ranks (used by ``engine.plan_cache``,
not by the planner).
"""

from .model import ENTRY_ALIGN, GlobalSavePlan, LocalSavePlan, RankSavePlan, WriteEntry
from .plan import plan_save

__all__ = ["ENTRY_ALIGN", "GlobalSavePlan", "LocalSavePlan", "RankSavePlan", "WriteEntry", "plan_save"]
