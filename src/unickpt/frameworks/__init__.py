"""Framework adapters: live objects <-> shard specs (translation only, no I/O, no collectives)."""

from . import fsdp1 as _fsdp1  # noqa: F401  (registers fsdp)
from . import generic as _generic  # noqa: F401  (registers torch, ddp, fsdp2, dtensor)
from .base import (
    FrameworkAdapter,
    LoadView,
    SaveView,
    get_framework,
    register_framework,
    registered_frameworks,
)

__all__ = ["FrameworkAdapter", "LoadView", "SaveView", "get_framework", "register_framework", "registered_frameworks"]
