"""The private ``torch.distributed`` accessors unickpt needs, in one place.

torch has no public way to read the job's timeout or the default store, and none to change a
process group's timeout after its creation, nor to tell a destroyed group. unickpt needs:
  ``job_timeout``       the timeout given to ``init_process_group`` (unickpt's groups inherit it);
  ``default_store``     the job's rendezvous store (unickpt marks arrivals there, to name the
                        ranks that did not come to a collective);
  ``set_group_timeout`` a per-call deadline on unickpt's own groups (``SaveOptions.timeout``);
  ``group_is_live``     whether a group survived ``destroy_process_group()``.
tests/integration/coordination/test_torch_private.py checks each against the installed torch, so a torch
release that changes them fails there, loudly, instead of silently falling back.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["job_timeout", "default_store", "set_group_timeout", "group_is_live"]


def job_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout ``group`` (default: the job's default group) was created with, or None if
    torch does not expose it (then the caller keeps torch's default)."""
    group = group or c10d._get_default_group()
    for device in getattr(group, "_device_types", ()):
        try:
            backend = group._get_backend(torch.device(device))
        except RuntimeError:
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    store_timeout = getattr(default_store(), "timeout", None)
    return store_timeout if isinstance(store_timeout, timedelta) else None


def default_store() -> dist.Store:
    """The store the default group was initialised with (``init_process_group``)."""
    return c10d._get_default_store()


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Make ``timeout`` the deadline of every later collective on ``group`` (gloo)."""
    c10d._set_pg_timeout(timeout, group)


def group_is_live(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered (``destroy_process_group()`` unregisters every
    group, and a later ``init_process_group`` may reuse a destroyed group's address)."""
    return group in c10d._world.pg_map
