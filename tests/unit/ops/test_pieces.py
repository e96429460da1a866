"""Bounded memory of ``merge``, ``diff`` and ``inspect --values`` (issue 26, item 8): tensors are
read in pieces of at most ``piece_bytes`` (``ops.pieces``), and a metadata claiming more bytes
than its data files hold is refused before anything is allocated.

Expected values never come from unickpt: the golden checkpoint's closed formula, ``safetensors``'
reader, numpy's ``ravel_multi_index`` for the row-major layout, torch on the original tensors.
Memory is measured as a child process's own peak RSS (``os.wait4``), against a child that only
imports; the 8 GiB claim runs under an address-space cap far below 8 GiB.

Its tests that start processes are in ``tests/integration/tools/test_tools_pieces_processes.py``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import unickpt
from tests.fixtures.golden_v1 import GOLDEN, expected_fsdp2_ws3
from tests.support.hypothesis_profiles import examples
from unickpt.format import METADATA_FILE
from unickpt.ops import merge as mg
from unickpt.ops.inspect import value_lines
from unickpt.ops.pieces import slabs


@settings(max_examples=examples(200), deadline=None)
@given(
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    piece=st.integers(1, 300),
)
def test_slabs_tile_the_tensor_in_row_major_order(shape: tuple[int, ...], itemsize: int, piece: int) -> None:
    """Each box is one contiguous run of the row-major order, the runs follow each other and
    cover every element once, and each is at most ``piece`` bytes (or one element)."""
    total = math.prod(shape)
    if not shape:  # a 0-d tensor: one box of one element
        assert list(slabs(shape, itemsize, piece)) == [((), ())]
        return
    at = 0
    for offsets, lengths in slabs(shape, itemsize, piece):
        n = math.prod(lengths)
        if total == 0:
            assert n == 0
            continue
        assert n >= 1 and (n * itemsize <= piece or n == 1), (offsets, lengths)
        idx = np.indices(lengths).reshape(len(shape), -1) + np.array(offsets).reshape(-1, 1)
        flat = np.ravel_multi_index(tuple(idx), shape) if shape else np.zeros(1, dtype=np.int64)
        assert list(flat) == list(range(at, at + n)), (shape, offsets, lengths)
        at += n
    assert at == total


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(str(folder / name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("piece_bytes", [4, 24, 100])
def test_merge_in_pieces_smaller_than_the_tensors_is_bit_exact(tmp_path: Path, piece_bytes: int) -> None:
    """The ws3 golden checkpoint (tensors split over 3 saving ranks) merged with pieces smaller
    than a row (4 bytes: one element) or than the tensors: the same bytes as the formula."""
    out = tmp_path / "merged"
    lines: list[str] = []
    mg.merge(os.path.join(GOLDEN, "v1_fsdp2_ws3"), str(out), piece_bytes=piece_bytes, report=lines.append)
    got = _read_safetensors(out)
    want = expected_fsdp2_ws3()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8))
    assert len(lines) == 1 and "model.safetensors" in lines[0], lines


def test_merge_cast_in_pieces_across_files(tmp_path: Path) -> None:
    out = tmp_path / "merged"
    mg.merge(os.path.join(GOLDEN, "v1_fsdp2_ws3"), str(out), dtype="bf16", max_shard_bytes=100, piece_bytes=16)
    got = _read_safetensors(out)
    for k, v in expected_fsdp2_ws3().items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert torch.equal(got[k], want), k


def test_inspect_values_statistics_over_pieces(tmp_path: Path) -> None:
    """min / max / mean / std / non-finite over a tensor read in 64-byte pieces, against torch
    on the whole tensor."""
    from unickpt.ops.inspect import load_metadata

    torch.manual_seed(1)
    t = torch.randn(37, 11, dtype=torch.float64) * 3 + 1
    t[5, 3] = float("inf")
    finite = t[torch.isfinite(t)]
    ck = tmp_path / "ck"
    unickpt.save(str(ck), {"model": torch.nn.ParameterDict({"w": torch.nn.Parameter(t)})})
    storage, md, _ = load_metadata(str(ck))
    stats = value_lines(md, storage, "model.w", piece_bytes=64)[2].split()
    got = dict(zip(stats[0::2], stats[1::2]))
    assert float(got["min"]) == pytest.approx(float(t.min()), rel=1e-5)
    assert got["max"] == "inf" and got["non-finite"] == "1"
    t2 = t.clone()
    t2[5, 3] = 0.0
    storage2 = tmp_path / "ck2"
    unickpt.save(str(storage2), {"model": torch.nn.ParameterDict({"w": torch.nn.Parameter(t2)})})
    s2, md2, _ = load_metadata(str(storage2))
    stats2 = value_lines(md2, s2, "model.w", piece_bytes=64)[2].split()
    got2 = dict(zip(stats2[0::2], stats2[1::2]))
    assert float(got2["mean"]) == pytest.approx(float(t2.mean()), rel=1e-5)
    assert float(got2["std"]) == pytest.approx(float(t2.std()), rel=1e-5)
    assert float(got2["max"]) == pytest.approx(float(t2.max()), rel=1e-5)
    assert finite.numel() == t.numel() - 1
    first = value_lines(md2, s2, "model.w", piece_bytes=8)[3]
    assert first == f"  first 10: {t2.reshape(-1)[:10].tolist()}"


def test_diff_over_pieces_counts_every_difference(tmp_path: Path) -> None:
    torch.manual_seed(2)
    a = torch.randn(50, 13)
    b = a.clone()
    b[3, 4] += 0.5
    b[49, 12] -= 2.0
    b[20] += 0.25  # a whole row: 13 elements
    for name, t in (("a", a), ("b", b)):
        unickpt.save(str(tmp_path / name), {"model": torch.nn.ParameterDict({"w": torch.nn.Parameter(t)})})
    from unickpt.ops.diff import diff

    report = diff(str(tmp_path / "a"), str(tmp_path / "b"), piece_bytes=40)
    (d,) = report.differ
    n = int((a != b).sum())
    assert (
        n == 15
        and d.detail
        == f"{n} of {a.numel()} elements differ, max |a-b| {float((a.double() - b.double()).abs().max()):.6g}"
    )


def test_merge_reports_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """Item 15: not a terminal: one stderr line per output file written, then the summary on
    stdout; a terminal: a tqdm bar on stderr that reaches the total."""
    import io

    from unickpt import cli

    src = os.path.join(GOLDEN, "v1_fsdp2_ws3")
    assert cli.main(["merge", src, str(tmp_path / "a"), "--max-shard-size", "100B"]) == 0
    out, err = capsys.readouterr()
    files = sorted(f for f in os.listdir(tmp_path / "a") if f.endswith(".safetensors"))
    lines = err.strip().splitlines()
    assert len(files) >= 2 and [x.split()[3] for x in lines] == files, err
    assert all(x.startswith("unickpt merge: wrote ") for x in lines) and f"of {len(files)}:" in lines[-1], err
    assert out.startswith(f"merged {len(expected_fsdp2_ws3())} tensors into "), out

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert cli.main(["merge", src, str(tmp_path / "b")]) == 0
    total = sum(t.numel() * t.element_size() for t in expected_fsdp2_ws3().values())
    assert "merge: 100%" in term.getvalue() and f"{total}/{total}" in term.getvalue(), term.getvalue()
    assert "wrote" not in term.getvalue()


def _as_format_v1(path: Path) -> None:
    """Rewrite the metadata of a one-tensor checkpoint as format version 1 writes it: one
    checksum per saved shard (CRC32C of the shard's bytes, computed here with ``crc32c``)."""
    import crc32c

    md = json.loads((path / METADATA_FILE).read_text())
    ((key, rec),) = md["tensors"].items()
    nd = len(rec["shape"])
    rows = []
    for row in rec["shards"]:
        lengths, f, offset = row[nd : 2 * nd], row[2 * nd], row[2 * nd + 1]
        nbytes = math.prod(lengths) * 4  # float32
        with open(path / md["files"][f], "rb") as fh:
            fh.seek(offset)
            rows.append([*row[: 2 * nd], f, offset, nbytes, crc32c.crc32c(fh.read(nbytes))])
    doc = {k: md[k] for k in ("magic", "save_id", "created_unix", "role", "topology", "files", "objects", "blobs")}
    doc.update(format_version=1, tensors={key: {"dtype": rec["dtype"], "shape": rec["shape"], "shards": rows}})
    (path / METADATA_FILE).write_text(json.dumps(doc))


def test_per_shard_checksums_are_checked_once_not_per_piece(tmp_path: Path, monkeypatch) -> None:
    """A format-version-1 checkpoint (one checksum per saved shard) of a 1 MiB tensor merged in
    16 KiB pieces reads each byte at most twice (a streamed check, then the pieces), not the
    whole shard for each of the 64 pieces; a flipped byte is still refused."""
    from unickpt.errors import ChecksumMismatchError
    from unickpt.storage.local import LocalStorage

    read = 0
    plain = LocalStorage.read_into

    def counting(self, name: str, offset: int, out: memoryview) -> None:
        nonlocal read
        read += len(out)
        plain(self, name, offset, out)

    monkeypatch.setattr(LocalStorage, "read_into", counting)
    monkeypatch.setattr(LocalStorage, "read_into_cached", counting)
    torch.manual_seed(3)
    t = torch.randn(256, 1024)
    src = tmp_path / "v1"
    unickpt.save(str(src), {"model": torch.nn.ParameterDict({"w": torch.nn.Parameter(t)})})
    _as_format_v1(src)
    mg.merge(str(src), str(tmp_path / "a"), piece_bytes=16 << 10)
    assert 0 < read <= 2 * t.numel() * 4, read
    assert torch.equal(_read_safetensors(tmp_path / "a")["model.w"], t)
    victim = next(p for p in (src / "data").rglob("*.bin") if p.is_file())
    raw = bytearray(victim.read_bytes())
    raw[len(raw) - 5] ^= 0xFF  # in the last piece: refused before the first piece is written
    victim.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=r"^checksum mismatch in .*'model\.w' shard"):
        mg.merge(str(src), str(tmp_path / "b"), piece_bytes=16 << 10)
