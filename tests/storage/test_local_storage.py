"""LocalStorage: direct-I/O writes reproduce the bytes exactly, ranged reads, missing values."""

from __future__ import annotations

import os

import numpy as np
import pytest

from unickpt.errors import MissingDataFileError, TruncatedDataFileError
from unickpt.storage.aligned import AlignedBuffer
from unickpt.storage.local import LocalStorage


@pytest.mark.parametrize("direct", [True, False])
def test_write_mixed_aligned_and_unaligned_parts(tmp_path, monkeypatch, direct):
    monkeypatch.setattr(LocalStorage, "direct_io", direct)
    s = LocalStorage(str(tmp_path))
    rng = np.random.default_rng(0)
    for trial in range(12):
        parts = []
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(0, 20 << 20))
            if rng.random() < 0.4:
                b = AlignedBuffer(n)
                np.frombuffer(b.view, np.uint8)[:n] = rng.integers(0, 255, n, dtype=np.uint8)
                parts.append(b.view[:n])
            else:
                a = rng.integers(0, 255, n + 3, dtype=np.uint8)
                parts.append(memoryview(a[int(rng.integers(0, 3)):][:n]))
        s.write(f"d/f{trial}.bin", parts)
        want = b"".join(bytes(p) for p in parts)
        assert s.size(f"d/f{trial}.bin") == len(want)
        assert open(tmp_path / "d" / f"f{trial}.bin", "rb").read() == want
        if want:
            off = int(rng.integers(0, len(want)))
            out = bytearray(min(1000, len(want) - off))
            s.read_into(f"d/f{trial}.bin", off, memoryview(out))
            assert bytes(out) == want[off:off + len(out)]


def test_missing_is_a_value_and_errors_name_the_file(tmp_path):
    s = LocalStorage(str(tmp_path))
    assert s.size("nope") is None and s.read("nope") is None and s.list() == []
    with pytest.raises(MissingDataFileError, match="nope"):
        s.read_into("nope", 0, memoryview(bytearray(4)))
    s.write("short.bin", [b"abc"])
    with pytest.raises(TruncatedDataFileError, match="short.bin"):
        s.read_into("short.bin", 1, memoryview(bytearray(8)))


def test_commit_is_atomic_replace_and_delete_prunes_empty_dirs(tmp_path):
    s = LocalStorage(str(tmp_path))
    s.commit("meta.json", b"one")
    s.commit("meta.json", b"two")
    assert s.read("meta.json") == b"two"
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []
    s.write("data/x/a.bin", [b"1"])
    s.delete(["data/x/a.bin"])
    assert not (tmp_path / "data").exists()
