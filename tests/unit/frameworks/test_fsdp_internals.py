"""Guards the private FSDP attributes unickpt reads (frameworks._fsdp_internals).

Real FSDP1 and FSDP2 modules on gloo (2 ranks, tiny): every accessor must return what the FSDP1
adapter relies on (types, shapes, invariants, and the local data FSDP's metadata points at), so a
torch release that renames or changes one fails here, naming the attribute, instead of in a
resharding test (or silently). Expected values come from an unwrapped copy of the same model
(same seed) and from plain arithmetic, never from unickpt.

Its tests that start processes are in ``tests/integration/frameworks/test_fsdp_internals_processes.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from unickpt.errors import FrameworkError
from unickpt.frameworks import _fsdp_internals as internals
from unickpt.frameworks.module_state import clean_fqn


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)  # 15 + 3 elements: odd, so shards split parameters
        self.register_buffer("count", torch.arange(4.0))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3)
        self.inner = Inner()
        self.head = nn.Linear(3, 7, bias=False)
        self.head.weight = self.embed.weight  # tied: one primary, one alias
        self.scale = nn.Parameter(torch.tensor([2.5]))  # one element: held by one rank only


def test_changed_private_attribute_fails_loudly_naming_it():
    """What a torch release that renamed an attribute would produce: a FrameworkError naming it
    and the torch version (not an AttributeError, not a silent fallback)."""
    with pytest.raises(FrameworkError, match=r"FullyShardedDataParallel\._handle does not exist") as info:
        internals.flat_param_of(nn.Linear(2, 2))
    assert torch.__version__ in str(info.value) and "_fsdp_internals" in str(info.value)
    renamed = SimpleNamespace(in_shard=True, offset_in_shard=0, numel_in_shard=2)  # no intra_param_start_idx
    flat = SimpleNamespace(_shard_param_infos=[renamed])
    with pytest.raises(FrameworkError, match=r"_ShardParamInfo\.intra_param_start_idx does not exist"):
        internals.shard_runs(flat)  # type: ignore[arg-type]
    with pytest.raises(FrameworkError, match=r"FlatParameter\._sharded_size is list, not a sequence of ints"):
        internals.sharded_numel(SimpleNamespace(_sharded_size=["3"]))  # type: ignore[arg-type]


def test_wrapper_segments_are_the_names_torch_inserts():
    """torch.compile and activation checkpointing wrap modules under private attribute names
    that ``clean_fqn`` drops (``_fsdp_internals.WRAPPER_SEGMENTS``; FSDP1's is checked above)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    ref = Net()
    names = sorted(n for n, _ in ref.named_parameters())
    wrapped = Net()
    wrapped.inner = checkpoint_wrapper(wrapped.inner)  # type: ignore[assignment]
    compiled = torch.compile(wrapped)
    raw = [n for n, _ in compiled.named_parameters()]
    assert any("_orig_mod" in n for n in raw) and any("_checkpoint_wrapped_module" in n for n in raw), raw
    assert sorted(clean_fqn(n, True) for n in raw) == names
