"""Non-tensor training state: extra state (RNG, scheduler, step) and dataloader state."""

from .extra import extra_blob_key, pick_extra_blob, rng_state, set_rng_state

__all__ = ["rng_state", "set_rng_state", "extra_blob_key", "pick_extra_blob"]
