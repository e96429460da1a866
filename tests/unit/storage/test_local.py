"""LocalStorage: direct-I/O writes reproduce the bytes exactly, ranged reads, missing values."""

from __future__ import annotations

import os

import numpy as np
import pytest

from unickpt.errors import MissingDataFileError, TruncatedDataFileError
from unickpt.folder.publish import publish
from unickpt.storage import StorageOptions
from unickpt.storage.aligned import AlignedBuffer
from unickpt.storage.local import LocalStorage


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(
    "max_part",
    [
        # parts up to 20 MiB cross the 16 MiB bounce buffer and (four of them) the 64 MiB direct
        # segment: ~0.5 GB written per run, seconds of disk time: the full suite only
        pytest.param(20 << 20, marks=pytest.mark.slow, id="20MiB"),
        pytest.param(3 << 20, id="3MiB"),  # across the 1 MiB direct minimum and 4 KiB alignment
    ],
)
def test_write_mixed_aligned_and_unaligned_parts(tmp_path, direct, max_part):
    s = LocalStorage(str(tmp_path), StorageOptions(direct_writes=direct))
    rng = np.random.default_rng(0)
    for trial in range(12):
        parts = []
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(0, max_part))
            if rng.random() < 0.4:
                b = AlignedBuffer(n)
                np.frombuffer(b.view, np.uint8)[:n] = rng.integers(0, 255, n, dtype=np.uint8)
                parts.append(b.view[:n])
            else:
                a = rng.integers(0, 255, n + 3, dtype=np.uint8)
                parts.append(memoryview(a[int(rng.integers(0, 3)) :][:n]))
        s.write(f"d/f{trial}.bin", parts)
        want = b"".join(bytes(p) for p in parts)
        assert s.size(f"d/f{trial}.bin") == len(want)
        assert open(tmp_path / "d" / f"f{trial}.bin", "rb").read() == want
        if want:
            off = int(rng.integers(0, len(want)))
            out = bytearray(min(1000, len(want) - off))
            s.read_into(f"d/f{trial}.bin", off, memoryview(out))
            assert bytes(out) == want[off : off + len(out)]


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
    publish(s, "meta.json", b"one")
    publish(s, "meta.json", b"two")
    assert s.read("meta.json") == b"two"
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []
    s.write("data/x/a.bin", [b"1"])
    s.delete(["data/x/a.bin"])
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("direct", [True, False])
def test_large_ranged_reads_match_the_file(tmp_path, direct):
    """Direct reads: any offset and length, into page-aligned memory with and without the file
    offset's page phase and into unaligned memory; truncation is reported, not padded."""
    s = LocalStorage(str(tmp_path), StorageOptions(direct_reads=direct))
    rng = np.random.default_rng(1)
    size = (40 << 20) + 1234
    data = rng.integers(0, 255, size, dtype=np.uint8)
    s.write("f.bin", [memoryview(data)])
    want = data.tobytes()
    dst = AlignedBuffer(20 << 20)
    cases = [
        (0, 20 << 20, 0),
        (4096, 17 << 20, 0),
        (4096 * 3 + 64, (1 << 20) + 7, 64),
        (size - (3 << 20), 3 << 20, 0),
        (123457, (16 << 20) + 5, 11),
    ]
    cases += [
        (int(rng.integers(0, size - (2 << 20))), int(rng.integers(1 << 20, 2 << 20)), int(rng.integers(0, 4096)))
        for _ in range(20)
    ]
    for off, n, phase in cases:
        for read in (s.read_into, s.read_into_cached):
            out = dst.view[phase : phase + n]
            out[:] = bytes(n)
            read("f.bin", off, out)
            assert bytes(out) == want[off : off + n], (off, n, phase)
    unaligned = bytearray((2 << 20) + 3)
    s.read_into("f.bin", 5000, memoryview(unaligned)[3:])
    assert bytes(unaligned[3:]) == want[5000 : 5000 + (2 << 20)]
    for off in (size - (1 << 20), size - (1 << 20) + 4096, size - 5):
        with pytest.raises(TruncatedDataFileError, match=f"ends at {size}"):
            s.read_into("f.bin", off, dst.view[: 2 << 20])


def test_large_reads_bypass_the_page_cache_unless_cached(tmp_path, monkeypatch):
    from unickpt.storage import local

    s = LocalStorage(str(tmp_path), StorageOptions(direct_reads=True))
    s.write("f.bin", [bytes(3 << 20)])
    flags: list[int] = []
    real_open = os.open

    def spy(p, f, *a, **k):
        if not f & os.O_DIRECTORY:  # the file's open, not its folders'
            flags.append(f)
        return real_open(p, f, *a, **k)

    monkeypatch.setattr(local.os, "open", spy)
    s.read_into("f.bin", 0, memoryview(bytearray(2 << 20)))  # large: direct
    s.read_into("f.bin", 0, memoryview(bytearray(1000)))  # small: buffered
    s.read_into_cached("f.bin", 0, memoryview(bytearray(2 << 20)))  # shared bytes: buffered
    assert [bool(f & os.O_DIRECT) for f in flags] == [True, False, False]
    monkeypatch.delenv("UNICKPT_DIRECT_READS", raising=False)
    s = LocalStorage(str(tmp_path))  # the default: buffered
    flags.clear()
    s.read_into("f.bin", 0, memoryview(bytearray(2 << 20)))
    assert [bool(f & os.O_DIRECT) for f in flags] == [False]


def test_direct_write_in_parallel_segments(tmp_path, monkeypatch):
    """Segments cut at aligned offsets and written by several threads reproduce the stream,
    whatever mix of aligned and unaligned parts crosses the cuts."""
    from unickpt.storage import local

    monkeypatch.setattr(local, "_SEGMENT", 1 << 20)
    s = LocalStorage(str(tmp_path))
    rng = np.random.default_rng(2)
    aligned = AlignedBuffer(3 << 20)
    np.frombuffer(aligned.view, np.uint8)[:] = rng.integers(0, 255, 3 << 20, dtype=np.uint8)
    odd = rng.integers(0, 255, (5 << 20) + 17, dtype=np.uint8)
    for trial in range(6):
        parts = [
            aligned.view[: (2 << 20) + 4096 * trial],
            memoryview(odd[trial:]),
            aligned.view[4096 : 4096 + 12345 * trial],
            memoryview(odd[: 999 * trial]),
        ]
        s.write(f"f{trial}.bin", parts)
        want = b"".join(bytes(p) for p in parts)
        assert open(tmp_path / f"f{trial}.bin", "rb").read() == want
    assert [len(v) for _, seg in local._segments([memoryview(bytes(5)), memoryview(bytes(7))], 4) for v in seg] == [
        4,
        1,
        3,
        4,
    ]


# ---------------------------------------------------------------- issue 26 item 5: folder links on load


def _saved(path) -> dict:
    import torch

    import unickpt

    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3)
    unickpt.save(str(path), {"model": model}, framework="torch")
    return {k: v.clone() for k, v in model.state_dict().items()}


def _load(path) -> dict:
    import torch

    import unickpt

    fresh = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    unickpt.load(str(path), {"model": fresh}, framework="torch")
    return fresh.state_dict()


def test_issue26_load_refuses_a_data_folder_that_is_a_link(tmp_path):
    """``data/<save_id>`` replaced by a link to a copy elsewhere: refused like a file link,
    naming the folder, never read through."""
    import shutil

    from unickpt.errors import UnsafePathError

    ckpt = tmp_path / "ck"
    _saved(ckpt)
    (save_folder,) = (ckpt / "data").iterdir()
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(save_folder, elsewhere)
    shutil.rmtree(save_folder)
    os.symlink(elsewhere, save_folder)
    with pytest.raises(UnsafePathError) as ei:
        _load(ckpt)
    msg = str(ei.value)
    assert str(save_folder) in msg and "symbolic link" in msg, msg
    # the data folder itself as a link: refused the same way
    os.unlink(save_folder)
    shutil.move(str(ckpt / "data"), tmp_path / "data-elsewhere")
    os.symlink(tmp_path / "data-elsewhere", ckpt / "data")
    shutil.copytree(elsewhere, tmp_path / "data-elsewhere" / save_folder.name)
    with pytest.raises(UnsafePathError, match="symbolic link") as ei:
        _load(ckpt)
    assert str(ckpt / "data") in str(ei.value)


def test_issue26_links_above_the_checkpoint_are_the_users_and_followed(tmp_path):
    """The user's own path may go through links (``runs/latest -> run_7``, a linked parent):
    only links inside the checkpoint are refused."""
    import torch

    real = tmp_path / "real_runs"
    real.mkdir()
    os.symlink(real, tmp_path / "runs")  # a linked parent folder
    want = _saved(tmp_path / "runs" / "ck")
    assert (real / "ck" / "data").is_dir()
    got = _load(tmp_path / "runs" / "ck")
    assert all(torch.equal(got[k], want[k]) for k in want)
    os.symlink(real / "ck", tmp_path / "latest")  # the checkpoint folder itself named by a link
    got = _load(tmp_path / "latest")
    assert all(torch.equal(got[k], want[k]) for k in want)
