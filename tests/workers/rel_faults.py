"""A storage backend that injects I/O errors, registered under the test scheme ``faulty://``.

``install_faulty_scheme(fail_op="write", fail_times=2, errno_code=errno.EIO, match="/data/")``
makes the next 2 ``write`` calls on names containing ``/data/`` raise ``OSError(EIO)`` before
touching the disk, then behave like ``LocalStorage``. ``open_storage`` wraps it in the retrying
layer like any backend, so the tests see exactly what production code sees.
"""

from __future__ import annotations

import errno
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from unickpt.storage import register_storage
from unickpt.storage.base import Buffer
from unickpt.storage.local import LocalStorage

_LOCK = threading.Lock()


class FaultyStorage(LocalStorage):
    """LocalStorage whose ``fail_op`` fails ``fail_times`` times on names containing ``match``."""

    def __init__(
        self, root: str, fail_op: str, fail_times: int, errno_code: int, match: str, counters: Counter
    ) -> None:
        super().__init__(root)
        self.fail_op, self.errno_code, self.match = fail_op, errno_code, match
        self.counters = counters  # shared by every instance of one installation

    def _maybe_fail(self, op: str, name: str) -> None:
        self.counters[f"{op} calls"] += 1
        self.counters[f"{op} {name}"] += 1
        if op != self.fail_op or self.match not in "/" + name:
            return
        with _LOCK:
            if self.counters["budget"] <= 0:
                return
            self.counters["budget"] -= 1
        self.counters[f"{op} injected"] += 1
        raise OSError(self.errno_code, f"injected {errno.errorcode.get(self.errno_code, '?')}")

    def write(self, name: str, parts: Sequence[Buffer]) -> None:
        self._maybe_fail("write", name)
        super().write(name, parts)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._maybe_fail("read", name)
        super().read_into(name, offset, out)

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        self._maybe_fail("read", name)
        super().read_into_cached(name, offset, out)

    def rename(self, src: str, dst: str) -> None:  # the metadata commit's publication step
        self._maybe_fail("rename", dst)
        super().rename(src, dst)


def install_faulty_scheme(fail_op: str, fail_times: int, errno_code: int = errno.EIO, match: str = "") -> Counter:
    """Register ``faulty://`` (replacing an earlier one); returns the shared counters."""
    counters: Counter = Counter()
    counters["budget"] = fail_times

    def factory(path: str, options: Any) -> Any:
        return FaultyStorage(path, fail_op, fail_times, errno_code, match, counters)

    register_storage("faulty", factory, replace=True)
    return counters
