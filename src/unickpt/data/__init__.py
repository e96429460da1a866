"""``unickpt.data``: dataloader state that reshards across data-parallel sizes.

- ``ReshardableLoader`` / ``LoaderState``: the protocol a loader implements (``unickpt_state``,
  ``load_unickpt_state``; see ``unickpt.state.loader``), so that ``unickpt.save`` stores its
  replicated state once and each of its numbered parts separately, and ``unickpt.load`` gives
  every part to exactly one DP rank of the new job.
- ``TokenPackingLoader``: a reference loader for LLM pre-training, usable in real jobs.
"""

from ..errors import LoaderStateError
from ..state.loader import LoaderIndex, LoaderState, ReshardableLoader, is_reshardable
from .token_packing import TokenPackingLoader

__all__ = [
    "LoaderState",
    "ReshardableLoader",
    "LoaderIndex",
    "LoaderStateError",
    "TokenPackingLoader",
    "is_reshardable",
]
