"""Helpers for the reliability tests: tiny states, bit-exact comparison and fault injection.

Multi-rank jobs in which a rank is killed on purpose run with ``harness.launch_ranks`` (the one
launcher, ``unickpt.testing.launch``); children call ``kill_at_phase`` / ``kill_in_commit`` to die
by SIGKILL at an exact point of a save. Reference states come from ``support.reference`` (torch's
own APIs), never from unickpt.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tests.support.reference import full_state

if TYPE_CHECKING:
    from unickpt.folder.lock_owner import LockOwner

# ----------------------------------------------------------------------------- tiny states


def tiny_model(seed: int = 0, width: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A two-layer MLP with AdamW state (one step taken), deterministic in ``seed``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, optim, seed)
    return model, optim


def step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(10_000 + seed)
    x = torch.randn(4, model[0].in_features, generator=g)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def snapshot(model: nn.Module, optim: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, cloned (collective for sharded models):
    ``support.reference.full_state``."""
    return full_state(model, optim)


def mismatches(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ bit for bit (or are missing on either side)."""

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    keys = set(got) | set(ref)
    return sorted(
        k
        for k in keys
        if k not in got
        or k not in ref
        or got[k].dtype != ref[k].dtype
        or got[k].shape != ref[k].shape
        or not torch.equal(raw(got[k]), raw(ref[k]))
    )


# ----------------------------------------------------------------------------- fault injection


def kill_at_phase(phase: str, rank: int, nth: int = 1) -> None:
    """SIGKILL this process at the ``nth`` event ``phase`` emitted by ``rank``."""
    import unickpt

    seen = [0]

    def listener(ev: Any) -> None:
        if ev.phase == phase and ev.rank == rank:
            seen[0] += 1
            if seen[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    unickpt.default_checkpointer().events.add_listener(listener)


def kill_in_commit(where: str) -> None:
    """SIGKILL this process in the metadata commit: ``"enter"`` right before the temporary
    metadata file is written, ``"rename"`` after it is written and fsynced, before the rename."""
    from unickpt.folder.publish import PutPublisher, RenamePublisher
    from unickpt.format.records import METADATA_FILE

    if where == "enter":  # either publication strategy (rename: files; put: object stores)
        for kind in (RenamePublisher, PutPublisher):
            real_publish = kind.publish

            def publish(self: Any, name: str, data: bytes, real: Any = real_publish) -> None:
                if name == METADATA_FILE:
                    os.kill(os.getpid(), signal.SIGKILL)
                real(self, name, data)

            kind.publish = publish  # type: ignore[method-assign]
    elif where == "rename":
        real_replace = os.replace

        def replace(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
            if os.path.basename(str(dst)) == METADATA_FILE:  # relative to a folder fd, or a path
                # the temporary metadata is complete on disk
                assert os.stat(src, dir_fd=kw.get("src_dir_fd")).st_size > 0
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst, *a, **kw)

        os.replace = replace  # type: ignore[assignment]
    else:
        raise ValueError(where)


# ----------------------------------------------------------------------------- save locks


def lock_record(**fields: Any) -> LockOwner:
    """A save-lock record of the current format: this process's (every field filled, a 60 s
    lease), save ``someone-else``, with ``fields`` replaced (an old ``renewed_unix`` and
    ``created_unix``: a holder whose heartbeat stopped; a dead ``pid``: a crashed one)."""
    from unickpt.folder.lock_owner import LockOwner

    me = LockOwner.for_this_process("someone-else")
    return LockOwner(**{**{f: getattr(me, f) for f in LockOwner.__slots__}, **fields})


def write_lock(folder: str, owner: LockOwner, generation: int = 1) -> bytes:
    """Write ``owner`` as the save lock's generation ``generation`` (``unickpt.save.lock.<n>``)
    in ``folder`` (created if missing), as another job holding the lock would; returns its bytes."""
    from unickpt.folder.markers import LOCK_FILE

    os.makedirs(folder, exist_ok=True)
    data = owner.encode()
    with open(os.path.join(folder, f"{LOCK_FILE}.{generation}"), "wb") as f:
        f.write(data)
    return data


# ----------------------------------------------------------------------------- folders


def data_files(folder: str) -> list[str]:
    """Every regular file under ``folder`` (relative names), sorted."""
    out = []
    for dirpath, _dirs, files in os.walk(folder):
        for f in files:
            out.append(os.path.relpath(os.path.join(dirpath, f), folder))
    return sorted(out)
