"""A load reads each local data file through one open file (``Storage.open_reader``,
``engine.load.open_files``): one open a file, not one a read; no more files open at once than
reader threads; every descriptor closed when the load ends, after a failed load too. A storage
that reads directly (no read-ahead) is read per call, as before."""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from unickpt.errors import ChecksumMismatchError
from unickpt.options import LoadOptions, ReadOptions
from unickpt.storage import StorageOptions, register_storage
from unickpt.storage.local import LocalStorage


class _Log:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.open_now = 0
        self.most_open = 0


class _Counted:
    def __init__(self, log: _Log, name: str, inner: Any) -> None:
        self.log, self.name, self.inner = log, name, inner

    def read_into(self, offset: int, out: memoryview) -> None:
        with self.log.lock:
            self.log.calls[f"handle read {self.name}"] += 1
        self.inner.read_into(offset, out)

    def read_into_cached(self, offset: int, out: memoryview) -> None:
        with self.log.lock:
            self.log.calls[f"handle read {self.name}"] += 1
        self.inner.read_into_cached(offset, out)

    def close(self) -> None:
        with self.log.lock:
            self.log.calls[f"close {self.name}"] += 1
            self.log.open_now -= 1
        self.inner.close()


class _Counting(LocalStorage):
    log = _Log()

    def open_reader(self, name: str) -> Any:
        handle = super().open_reader(name)
        with self.log.lock:
            self.log.calls[f"open {name}"] += 1
            self.log.open_now += 1
            self.log.most_open = max(self.log.most_open, self.log.open_now)
        return _Counted(self.log, name, handle)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        with self.log.lock:
            self.log.calls[f"call read {name}"] += 1
        super().read_into(name, offset, out)

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        with self.log.lock:
            self.log.calls[f"call read {name}"] += 1
        super().read_into_cached(name, offset, out)


@pytest.fixture
def log() -> _Log:
    fresh = _Log()
    _Counting.log = fresh
    register_storage("countopen", lambda path, options: _Counting("/" + path, options), replace=True)
    register_storage(
        "countdirect", lambda path, options: _Counting("/" + path, StorageOptions(direct_reads=True)), replace=True
    )
    return fresh


def _model(seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(4)))  # 4 x 4 MiB
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


def _saved(tmp_path) -> tuple[str, dict[str, torch.Tensor], dict[str, int]]:
    path = str(tmp_path / "ck")
    m = _model(1)
    unickpt.save(path, {"model": m}, options=unickpt.SaveOptions(files_per_rank=4))
    files = {
        os.path.relpath(os.path.join(top, f), path): os.path.getsize(os.path.join(top, f))
        for top, _, names in os.walk(path)
        for f in names
        if f.endswith(".bin")
    }
    assert len(files) == 4
    return path, {k: v.clone() for k, v in m.state_dict().items()}, files


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_each_data_file_is_opened_once_for_all_its_reads_and_closed(tmp_path, log) -> None:
    path, want, files = _saved(tmp_path)
    m = _model(2)
    fds = _fds()
    unickpt.load(f"countopen://{path}", {"model": m}, options=LoadOptions(io=ReadOptions(threads=2)))
    assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
    for name, size in files.items():
        assert log.calls[f"open {name}"] == 1 and log.calls[f"close {name}"] == 1, (name, log.calls)
        assert log.calls[f"handle read {name}"] >= 2, (name, size, log.calls)  # many reads, one open
        assert log.calls[f"call read {name}"] == 0, (name, log.calls)
    assert 1 <= log.most_open <= 2 and log.open_now == 0  # at most one file a reader thread
    assert _fds() == fds


def test_a_failed_load_closes_every_file_it_opened(tmp_path, log) -> None:
    path, _, files = _saved(tmp_path)
    victim = os.path.join(path, sorted(files)[1])
    with open(victim, "r+b") as f:
        f.seek(files[sorted(files)[1]] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    fds = _fds()
    with pytest.raises(ChecksumMismatchError):
        unickpt.load(f"countopen://{path}", {"model": _model(2)}, options=LoadOptions(io=ReadOptions(threads=2)))
    opened = {k.split(" ", 1)[1] for k in log.calls if k.startswith("open ")}
    assert opened and all(log.calls[f"close {n}"] == log.calls[f"open {n}"] == 1 for n in opened), log.calls
    assert log.open_now == 0 and _fds() == fds


def test_direct_reads_stay_one_call_a_read(tmp_path, log) -> None:
    """O_DIRECT reads have no read-ahead (``reads_ahead`` False): nothing is opened for a
    stream; every read is a ``read_into`` call of its own."""
    path, want, files = _saved(tmp_path)
    m = _model(3)
    unickpt.load(f"countdirect://{path}", {"model": m})
    assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
    assert not any(k.startswith(("open ", "handle read ")) for k in log.calls), log.calls
    assert all(log.calls[f"call read {name}"] >= 1 for name in files), log.calls
