"""The contract suite can fail: each deliberately broken backend below breaks one promise of
``storage.base``, and the contract test for that promise catches it (while the same test passes
on the correct memory backend, the control)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from tests.fixtures.contract import StorageContract
from unickpt.storage.memory import CAPABILITIES, MemoryStorage, MemoryStore

_CONTRACT_FAILURES = (AssertionError, pytest.fail.Exception)


class TornPut(MemoryStorage):
    """Claims atomic puts but writes an object in two steps: its first half becomes visible,
    and (the first time) stays so until a reader has seen it (deterministic: that put waits for
    the read)."""

    capabilities = replace(CAPABILITIES, atomic_put=True, atomic_rename=False, rename_replaces=False)

    def __init__(self, root: str, store: MemoryStore, seen: threading.Event) -> None:
        super().__init__(root, store=store)
        self._seen = seen
        self._torn_seen = False

    def put(self, name: str, data: bytes) -> None:
        if len(data) > 1:
            super().put(name, data[: len(data) // 2])
            if not self._torn_seen:
                self._seen.clear()
                self._seen.wait(5)
                self._torn_seen = True
        super().put(name, data)

    def read(self, name: str, limit: int = 1 << 30) -> bytes | None:
        out = super().read(name, limit)
        self._seen.set()
        return out


class RacyCreate(MemoryStorage):
    """``create_exclusive`` as check-then-set: two creators that both checked before either set
    (forced with a barrier) both win."""

    def __init__(self, root: str, store: MemoryStore, gate: threading.Barrier) -> None:
        super().__init__(root, store=store)
        self._gate = gate

    def create_exclusive(self, name: str, data: bytes) -> bool:
        if self.size(name) is not None:
            return False
        try:
            self._gate.wait(2)
        except threading.BrokenBarrierError:
            self._gate.reset()
        self.put(name, data)
        return True


class NoNameChecks(MemoryStorage):
    """Accepts any name, ``..`` included."""

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"


class PaddedReads(MemoryStorage):
    """Reads past the end are padded with zeros instead of failing."""

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        data = self.read(name)
        if data is None:
            super().read_into(name, offset, out)
            return
        chunk = data[offset : offset + len(out)]
        out[: len(chunk)] = chunk
        out[len(chunk) :] = bytes(len(out) - len(chunk))

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        self.read_into(name, offset, out)


def _factories() -> dict[str, Callable[[], Callable[[str], Any]]]:
    def torn() -> Callable[[str], Any]:
        store, seen = MemoryStore(), threading.Event()
        return lambda root: TornPut(root, store, seen)

    def racy() -> Callable[[str], Any]:
        store, gate = MemoryStore(), threading.Barrier(2)
        return lambda root: RacyCreate(root, store, gate)

    def unchecked() -> Callable[[str], Any]:
        store = MemoryStore()
        return lambda root: NoNameChecks(root, store=store)

    def padded() -> Callable[[str], Any]:
        store = MemoryStore()
        return lambda root: PaddedReads(root, store=store)

    return {"torn put": torn, "racy create": racy, "no name checks": unchecked, "padded reads": padded}


CASES = [  # (broken backend, the contract test that must catch it, its arguments, what it reports)
    ("torn put", "test_publish_is_atomic_for_readers", {}, "a torn object"),
    ("racy create", "test_exclusive_create_has_exactly_one_winner", {}, "2 creators won"),
    ("no name checks", "test_names_escaping_the_root_are_refused", {"bad": "../x"}, "DID NOT RAISE"),
    ("padded reads", "test_reads_past_the_end_or_of_missing_objects_fail_precisely", {"cached": False}, "DID NOT"),
]


@pytest.mark.parametrize("broken,test,kwargs,report", CASES, ids=[c[0] for c in CASES])
def test_a5_contract_suite_catches_a_broken_backend(broken, test, kwargs, report):
    contract = StorageContract()
    control = MemoryStore()
    getattr(contract, test)(lambda root: MemoryStorage(root, store=control), **kwargs)  # the control passes
    with pytest.raises(_CONTRACT_FAILURES, match=report):
        getattr(contract, test)(_factories()[broken](), **kwargs)
