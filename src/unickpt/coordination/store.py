"""The key-value store ranks report through (``coordination.barrier``), and an in-memory one.

``KeyValueStore`` is the part of ``torch.distributed.Store`` unickpt uses, with its semantics:
``get`` waits for a missing key (up to the store's own timeout), ``wait`` for every key of a
list up to ``timeout`` (else raises), ``compare_set(key, "", v)`` sets ``v`` only where ``key``
is absent and returns the value the key holds afterwards, ``add`` returns the new count,
``append`` concatenates. A coordinator hands the store of its job to the barrier as a
``StoreScope``: the store, a key prefix no other group of the job uses, the deadline and a label.

``MemoryStore`` implements it for thread-ranks (``unickpt.testing.threads``); ``on_wait`` (tests)
is called with the keys of each ``wait`` before it blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

__all__ = ["KeyValueStore", "StoreScope", "MemoryStore"]


class KeyValueStore(Protocol):
    def set(self, key: str, value: bytes | str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def append(self, key: str, value: bytes | str) -> None: ...

    def check(self, keys: list[str]) -> bool: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes: ...

    def delete_key(self, key: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class StoreScope:
    """Where a coordinator's ranks report: ``store``, under keys starting with ``prefix``
    (unique to its group in the job), waiting at most ``timeout`` seconds; ``label`` names the
    save in errors; ``warn_every``: seconds between the warnings of a rank that waits there
    (``coordination.waits``; None: none), which read the reports over ``watch_store`` (a
    connection of their own; None: ``store``, which must then serve concurrent requests)."""

    store: KeyValueStore
    prefix: str
    timeout: float
    label: str
    warn_every: float | None = None
    watch_store: KeyValueStore | None = None


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class MemoryStore:
    """``KeyValueStore`` in one process (thread-ranks); ``timeout``: what ``get`` waits for a
    missing key."""

    def __init__(self, timeout: float = 30.0, on_wait: Callable[[list[str]], None] | None = None) -> None:
        self.timeout = timeout
        self.on_wait = on_wait
        self._cond = threading.Condition()
        self._data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes | str) -> None:
        with self._cond:
            self._data[key] = _bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key], timedelta(seconds=self.timeout))
        with self._cond:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            n = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(n).encode()
            self._cond.notify_all()
            return n

    def append(self, key: str, value: bytes | str) -> None:
        with self._cond:
            self._data[key] = self._data.get(key, b"") + _bytes(value)
            self._cond.notify_all()

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        if self.on_wait is not None:
            self.on_wait(list(keys))
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while not all(k in self._data for k in keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [k for k in keys if k not in self._data]
                    raise TimeoutError(f"wait timeout after {timeout.total_seconds():g}s, keys: {missing}")
                self._cond.wait(remaining)

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        expected, desired = _bytes(expected_value), _bytes(desired_value)
        with self._cond:
            current = self._data.get(key)
            if current is None:
                if expected:
                    return expected  # torch's stores: nothing set, the expected value returned
                self._data[key] = desired
                self._cond.notify_all()
                return desired
            if current == expected:
                self._data[key] = desired
                self._cond.notify_all()
                return desired
            return current

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def keys(self) -> list[str]:
        """Every key now (tests: what a barrier left behind)."""
        with self._cond:
            return sorted(self._data)
