"""The ``state`` dict a save or load is given, and its non-tensor parts.

``layout`` (``StateLayout``: one ``StateItem`` per key, checked before anything is written or
read), ``items`` (the kinds of value a key holds and how each is saved and applied), ``extra``
(RNG, scheduler, step and other plain values, in the safe value encoding) and ``loader``
(dataloader state that survives a change of the data-parallel size).

The names below come from ``extra`` (which imports torch) on first access, so that ``loader``
(torch-free: the ``"dataloader"`` metadata section) can be imported without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .extra import extra_blob_key, pick_extra_blob, rng_state, set_rng_state

__all__ = ["rng_state", "set_rng_state", "extra_blob_key", "pick_extra_blob"]


__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(__all__, ".extra"))
