"""The storage protocol is the whole contract: the engine, the save lock, the manager and the
tools use only the operations ``storage.base.Storage`` declares.

A strict wrapper exposes exactly the protocol's members of a real local backend and records any
other attribute the library asks for (the ``getattr(storage, "sync_dir", None)`` kind of probe of
an undeclared capability); whole saves, loads, manager runs, lock breaking and ``inspect`` go
through it.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import unickpt
from tests.support.compare import same_state
from unickpt.storage import base as storage_base
from unickpt.storage.base import Storage


def protocol_members() -> set[str]:
    """The names ``Storage`` declares (methods and attributes), read from the class itself."""
    names = {n for n in vars(Storage) if not n.startswith("_")}
    return names | set(getattr(Storage, "__annotations__", {}))


class StrictStorage:
    """Forwards the protocol's members to ``inner``; every other attribute is recorded in
    ``probes`` and refused (AttributeError), as a backend that implements only the protocol."""

    probes: ClassVar[list[str]] = []  # shared by every instance of one test (reset by the fixture)
    _lock = threading.Lock()

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "_inner", inner)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_inner", "probes", "_lock"):
            return object.__getattribute__(self, name)
        if name in protocol_members():
            return getattr(object.__getattribute__(self, "_inner"), name)
        with StrictStorage._lock:
            StrictStorage.probes.append(name)
        raise AttributeError(f"{name!r} is not part of the storage protocol")


@pytest.fixture
def strict_scheme():
    from unickpt.storage import register_storage
    from unickpt.storage.local import LocalStorage

    StrictStorage.probes = []

    def factory(path: str, *options: Any) -> Any:
        return StrictStorage(LocalStorage(path, *options))

    register_storage("strict", factory, replace=True)
    yield StrictStorage.probes


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 6)).square().mean().backward()
    optim.step()
    return {"model": model, "optimizer": optim, "extra_state": {"step": seed}}


def test_a1_engine_lock_manager_and_tools_use_only_declared_operations(tmp_path, strict_scheme):
    """Every storage access of a save (blocking and async, over an older checkpoint: lock,
    marker, sync, commit, cleanup), a load (deduplicated reads through the cached path), a
    manager's pointer and retention, breaking a stale lock and ``inspect --verify`` is one of the
    protocol's declared operations; nothing is probed with getattr."""
    from unickpt.folder.lock import read_lock_owner, try_acquire
    from unickpt.ops import inspect as ins
    from unickpt.storage import open_storage

    url = f"strict://{tmp_path}/ck"
    first, second = _state(1), _state(2)
    unickpt.save(url, first, framework="torch")
    unickpt.save(url, second, framework="torch", async_save=True).wait()
    fresh = _state(9)
    unickpt.load(url, fresh, framework="torch")
    assert same_state(fresh["model"].state_dict(), second["model"].state_dict()) and fresh["extra_state"] == {"step": 2}

    manager = unickpt.CheckpointManager(f"strict://{tmp_path}/run", keep_last=1)
    for step in (1, 2):
        manager.save(step, _state(step), framework="torch")
    assert [c.step for c in manager.list_checkpoints()] == [2]
    assert manager.load_latest(_state(7), framework="torch") == 2

    storage = open_storage(url)
    lock = try_acquire(storage, "held-by-test")
    found = read_lock_owner(storage)
    assert found is not None and found[1] == lock.owner
    lock.verify_holder()
    lock.release()

    _, md, _ = ins.load_metadata(url)
    report = ins.verify(md, storage)
    assert report.ok, report
    assert strict_scheme == [], f"undeclared storage attributes were probed: {sorted(set(strict_scheme))}"


def test_a1_protocol_declares_capabilities_and_every_backend_states_them(tmp_path):
    """The capability record is part of the protocol; each built-in backend states it once, as a
    frozen record, and the retrying wrapper shows its backend's."""
    import dataclasses

    from unickpt.storage import open_storage
    from unickpt.storage.local import LocalStorage
    from unickpt.storage.memory import MemoryStorage

    assert "capabilities" in protocol_members()
    caps_cls = storage_base.StorageCapabilities
    local, memory = LocalStorage(str(tmp_path)), MemoryStorage(f"protocol-{tmp_path.name}")
    for backend in (local, memory):
        caps = backend.capabilities
        assert isinstance(caps, caps_cls)
        with pytest.raises(dataclasses.FrozenInstanceError):
            caps.atomic_put = not caps.atomic_put  # type: ignore[misc]
        assert open_storage(backend.url if backend is memory else str(tmp_path)).capabilities == caps
        assert isinstance(backend, Storage)
    assert local.capabilities.shared_page_cache and local.capabilities.needs_sync
    assert local.capabilities.atomic_rename and not local.capabilities.atomic_put
    assert memory.capabilities.atomic_put and not memory.capabilities.needs_sync
