"""Framework adapters: live objects <-> shard specs (translation only, no I/O, no collectives).

``base``: the adapter protocol, the description records and the optimizer contract;
``registry``: ``FrameworkRegistry`` (the place to add a framework) and the default ``FRAMEWORKS``;
``views``: save and load views derived from one description (with ``targets``: load
destinations, ``optim_state``: optimizer state per parameter, ``param_groups``: hyper-parameters
checked then applied, ``module_state``: generic module and optimizer pieces, ``parts``: several
modules and optimizers as one); ``generic`` (torch, ddp, fsdp2, dtensor), ``fsdp1`` (fsdp),
``megatron`` and ``flat`` (tensors): the built-in adapters; ``_fsdp_internals``: every private
FSDP attribute unickpt reads.
"""

from .base import (
    FrameworkAdapter,
    LoadView,
    OptimizerDescription,
    OptimizerLike,
    ParamState,
    Piece,
    Role,
    SaveView,
    StateDescription,
    is_optimizer_like,
    supports_step_hooks,
)
from .registry import BUILTIN_PRIORITIES, FRAMEWORKS, FrameworkRegistry, get_framework, registered_frameworks
from .views import DescribedAdapter

__all__ = [
    "FrameworkAdapter",
    "DescribedAdapter",
    "FrameworkRegistry",
    "FRAMEWORKS",
    "BUILTIN_PRIORITIES",
    "get_framework",
    "registered_frameworks",
    "StateDescription",
    "OptimizerDescription",
    "ParamState",
    "Piece",
    "Role",
    "OptimizerLike",
    "is_optimizer_like",
    "supports_step_hooks",
    "SaveView",
    "LoadView",
]
