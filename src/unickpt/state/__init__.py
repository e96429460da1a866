"""The ``state`` dict a save or load is given, and its non-tensor parts.

``layout`` (``StateLayout``: one ``StateItem`` per key, checked before anything is written or
read), ``items`` (the kinds of value a key holds and how each is saved and applied), ``extra``
(RNG, scheduler, step and other plain values, in the safe value encoding) and ``loader``
(dataloader state that survives a change of the data-parallel size).
"""

from .extra import extra_blob_key, pick_extra_blob, rng_state, set_rng_state

__all__ = ["rng_state", "set_rng_state", "extra_blob_key", "pick_extra_blob"]
