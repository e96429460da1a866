"""Issue 39, items 1 to 4: the foreign readers of ``unickpt convert`` (``ops.torch_save_read`` for
verl's rank files, ``ops.dcp_read``, ``ops.hf_read``, ``verl_read.assemble``) hold no more bytes
than the files they read, build numpy arrays only from their bytes, refuse colliding names, and
read a storage's bytes from its zip entry without the rest of the entry.

Every source is written by torch (``torch.save``, ``dcp.save``) or safetensors in this process,
then spoiled where a test needs a lie: an expanded view is what ``torch.save`` writes for
``torch.zeros(1).expand(n)`` (one stored element). Expected values are the tensors saved, never
the reader's output. The hostile sizes (``2**33`` elements, ``[2**20] * 3``) are only ever asked
of code that must refuse them, or that refused them before with a raw error: no test allocates
them, on today's code or before it.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import struct
import tracemalloc
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from unickpt.errors import CorruptMetadataError, SizeLimitError
from unickpt.ops.convert import from_dcp, from_hf, from_verl_fsdp
from unickpt.ops.dcp_read import read_dcp_state
from unickpt.ops.torch_save_read import read_torch_save
from unickpt.ops.verl_read import Box, assemble

RANK0 = "model_world_size_1_rank_0.pt"


def _torch_save(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _dcp_with_entry(folder: Path, payload: bytes) -> None:
    """A DCP checkpoint whose non-tensor entry ``train_state.step`` is stored as ``payload`` (a
    ``torch.save`` file appended to the data file, as the repro of item 1 does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model.weight": torch.ones(4), "train_state": {"step": 5}},
            storage_writer=dcp.FileSystemWriter(str(folder)),
            no_dist=True,
        )
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written by DCP just now
    for index, info in list(md.storage_data.items()):
        if index.fqn == "train_state.step":
            data = folder / info.relative_path
            offset = data.stat().st_size
            with open(data, "ab") as f:
                f.write(payload)
            md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload))
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)


# --- item 1: a few stored bytes never pose as a large tensor ---


def test_issue39_item1_dcp_entry_holding_an_expanded_tensor_is_refused(tmp_path):
    """A 1.6 KB DCP entry holding ``torch.zeros(1).expand(2**20)`` was converted into 4 MiB
    (``2**27``: 716 MB, 2.7 GB RSS); ``2**33`` asked for 32 GiB. Refused naming file and entry."""
    _dcp_with_entry(tmp_path / "src", _torch_save({"x": torch.zeros(1).expand(1 << 20)}))
    with pytest.raises(SizeLimitError) as e:
        from_dcp(str(tmp_path / "src"), str(tmp_path / "out"))
    assert "__0_0.distcp" in str(e.value) and "'train_state.step'" in str(e.value), e.value
    assert "expanded view" in str(e.value) and "1048576" in str(e.value), e.value
    assert not (tmp_path / "out").exists()
    _dcp_with_entry(tmp_path / "huge", _torch_save([{"x": torch.zeros(1).expand(1 << 33)}]))
    with pytest.raises(SizeLimitError, match="8589934592 elements"):
        read_dcp_state(str(tmp_path / "huge"))  # refused as loaded: never copied or written


def test_issue39_item1_dcp_chunk_that_is_an_expanded_view_is_refused(tmp_path):
    """A tensor chunk stored as a stride-0 view of one element: refused, not copied."""
    src = tmp_path / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(64)}, storage_writer=dcp.FileSystemWriter(str(src)), no_dist=True)
    with open(src / ".metadata", "rb") as f:
        md = pickle.load(f)
    [(index, info)] = md.storage_data.items()
    payload = _torch_save(torch.full((1,), 3.0).expand(64))
    data = src / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload + bytes(max(0, 256 - len(payload))))  # the entry holds the chunk's 256 bytes
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=max(len(payload), 256))
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(SizeLimitError, match="tensor 'w'.*expanded view"):
        from_dcp(str(src), str(tmp_path / "out"))


@pytest.mark.parametrize(
    "shape",
    [(1 << 27,), (1 << 33,), (1 << 20, 1 << 20, 1 << 20)],
    ids=["2^27", "2^33", "[2^20]*3"],
)
def test_issue39_item1_verl_rank_file_with_an_expanded_tensor_is_refused(tmp_path, shape):
    """A 1.7 KB verl rank file gave a 134M-element tensor; ``[2**20] * 3`` asked for 4.6e18
    bytes (raw RuntimeError). The reader refuses the view before any copy, naming the file."""
    src = tmp_path / "src"
    src.mkdir()
    (src / RANK0).write_bytes(_torch_save({"w": torch.zeros(1).expand(*shape)}))
    assert (src / RANK0).stat().st_size < 4096
    with pytest.raises(SizeLimitError) as e:
        read_torch_save(str(src), RANK0, "test")
    assert RANK0 in str(e.value) and "expanded view" in str(e.value), e.value
    with pytest.raises(SizeLimitError):
        from_verl_fsdp(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_issue39_item1_overlapping_views_refused_and_ordinary_views_read(tmp_path):
    """Overlapping (non-zero strides) views are refused; slices, transposes and narrowed views of
    one storage, as torch.save writes them, come back equal to what was saved."""
    from unickpt.ops.torch_save_read import view_problem

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    views = {"t": base.T, "cols": base[:, 1::2], "row": base.narrow(0, 2, 1), "all": base, "empty": base[:0]}
    (tmp_path / "ok.pt").write_bytes(_torch_save(views))
    got = read_torch_save(str(tmp_path), "ok.pt", "test")
    for key, want in views.items():
        assert got[key].shape == want.shape and torch.equal(got[key], want), key
    windows = torch.as_strided(torch.arange(8.0), (6, 3), (1, 1))  # unfold-like: elements repeat
    (tmp_path / "bad.pt").write_bytes(_torch_save({"w": windows}))
    with pytest.raises(SizeLimitError, match="overlapping view"):
        read_torch_save(str(tmp_path), "bad.pt", "test")
    assert view_problem((3, 4), (4, 1)) is None and view_problem((4, 3), (1, 4)) is None
    assert view_problem((2, 2), (0, 1)) is not None and view_problem((5,), (0,)) is not None
    assert view_problem((1, 7), (0, 1)) is None  # a dimension of one element repeats nothing


def test_issue39_item1_dtensor_local_tensor_that_is_expanded_is_refused_by_assemble():
    """The shape ``[2**20] * 3`` reached ``assemble`` through a DTensor's local tensor (a
    stride-0 view tiles the box exactly) and failed with a raw RuntimeError allocating 4.6e18
    bytes. Refused before anything is allocated; an ordinary piece still assembles."""
    size = (1 << 20,) * 3
    piece = torch.zeros(1).expand(*size)
    with pytest.raises(SizeLimitError, match="w: a piece at offsets \\(0, 0, 0\\).*expanded view"):
        assemble("w", size, torch.float32, [Box((0, 0, 0), size, piece)])
    halves = torch.arange(6.0).reshape(2, 3)
    whole = assemble("w", (2, 3), torch.float32, [Box((0, 0), (1, 3), halves[:1]), Box((1, 0), (1, 3), halves[1:])])
    assert torch.equal(whole, halves)


def _dag(levels: int, leaf: Any) -> Any:
    d = [leaf]
    for _ in range(levels):
        d = [d, d]  # each level doubles the places the leaf is used in
    return d


def test_issue39_item1_one_stored_tensor_used_over_and_over_is_refused(tmp_path):
    """One 64 KiB tensor under 2,000 keys (an 80 KB rank file) was converted into 2,000 copies
    (125 MiB); in a list that holds itself twice 40 levels deep, 2^40 times. Refused: a file's
    values hold at most twice its bytes (plus 1 MiB), shared ones counted at each use. A tied
    weight (one tensor under two keys) still converts."""
    t = torch.arange(16384, dtype=torch.float32)
    src = tmp_path / "src"
    src.mkdir()
    (src / RANK0).write_bytes(_torch_save({f"k{i}": t for i in range(2000)}))
    with pytest.raises(SizeLimitError, match=f"{RANK0}: the file holds 131[0-9]{{6}} bytes of values"):
        from_verl_fsdp(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    (src / "extra_state_world_size_1_rank_0.pt").write_bytes(_torch_save({"rng": _dag(40, t)}))
    with pytest.raises(SizeLimitError, match=f"holds {(1 << 40) * t.nbytes + len('rng')} bytes of values"):
        read_torch_save(str(src), "extra_state_world_size_1_rank_0.pt", "test")
    from unickpt.ops.torch_save_read import value_bytes

    assert value_bytes(_dag(40, t)) == (1 << 40) * t.nbytes  # counted in 40 steps
    _dcp_with_entry(tmp_path / "dcp", _torch_save({"x": [t] * 100}))
    with pytest.raises(SizeLimitError, match="entry 'train_state.step' holds [0-9]+ bytes of values"):
        from_dcp(str(tmp_path / "dcp"), str(tmp_path / "out"))
    (src / RANK0).write_bytes(_torch_save({"embed": t, "head": t}))
    (src / "extra_state_world_size_1_rank_0.pt").unlink()
    assert from_verl_fsdp(str(src), str(tmp_path / "tied")).tensors == 2


# --- item 2: numpy arrays only from their bytes ---


class _Uninit:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __reduce__(self) -> Any:
        return (np.ndarray, (self.shape, np.dtype("f8")))  # memory nobody wrote


class _ShortState:
    def __reduce__(self) -> Any:  # numpy's own form, with a shape its bytes do not fill
        state = (1, (1 << 42,), np.dtype("f8"), False, bytes(8))
        return (np._core.multiarray._reconstruct, (np.ndarray, (0,), b"b"), state)


@pytest.mark.parametrize("shape", [(512,), (1 << 42,)], ids=["512", "2^42"])
def test_issue39_item2_numpy_array_never_built_from_unwritten_memory(tmp_path, shape):
    """``numpy.ndarray(shape, dtype)`` wrote heap contents into the converted RNG state; for
    ``(2**42,)`` a raw MemoryError escaped. Both are a CheckpointError naming the file."""
    src = tmp_path / "src"
    src.mkdir()
    (src / RANK0).write_bytes(_torch_save({"w": torch.ones(2)}))
    (src / "extra_state_world_size_1_rank_0.pt").write_bytes(_torch_save({"rng": {"probe": _Uninit(shape)}}))
    with pytest.raises(CorruptMetadataError, match="extra_state_world_size_1_rank_0.pt.*numpy.ndarray"):
        from_verl_fsdp(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_issue39_item2_numpy_arrays_come_from_their_bytes_only(tmp_path):
    """A state whose shape its bytes do not fill is refused; a real array (verl's numpy RNG
    state, uint32, and a float array) reads back equal."""
    (tmp_path / "short.pt").write_bytes(_torch_save({"rng": _ShortState()}))
    with pytest.raises(CorruptMetadataError, match="needs 35184372088832 bytes; the pickle gives it 8"):
        read_torch_save(str(tmp_path), "short.pt", "test")
    state = np.random.RandomState(7).get_state()
    floats = np.linspace(0.0, 1.0, 5).reshape(5, 1)
    (tmp_path / "ok.pt").write_bytes(_torch_save({"np": state, "f": floats}))
    got = read_torch_save(str(tmp_path), "ok.pt", "test")
    assert got["np"][0] == state[0] and np.array_equal(got["np"][1], state[1]) and got["np"][2:] == state[2:]
    assert got["np"][1].dtype == np.uint32 and np.array_equal(got["f"], floats)


# --- item 3: colliding names are refused ---


@pytest.mark.parametrize(
    "state",
    [{1: torch.ones(2), "1": torch.zeros(2)}, {("w",): torch.ones(2)}, {"w": torch.ones(2), 0: torch.zeros(1)}],
    ids=["int-and-str", "tuple", "int"],
)
def test_issue39_item3_verl_keys_that_are_not_strings_are_refused(tmp_path, state):
    """``{1: a, "1": b}`` converted with one tensor (the other silently dropped)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / RANK0).write_bytes(_torch_save(state))
    with pytest.raises(CorruptMetadataError, match=f"{RANK0}: the model state dict names an entry by the"):
        from_verl_fsdp(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_issue39_item3_same_tensor_name_in_two_hf_shards_is_refused(tmp_path):
    """Two shards holding ``a``: the shard read last won."""
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.ones(3), "b": torch.ones(1)}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"a": torch.zeros(3)}, str(hf / "model-00002-of-00002.safetensors"))
    index = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (hf / "model.safetensors.index.json").write_text(f'{{"metadata": {{}}, "weight_map": {_json(index)}}}')
    with pytest.raises(CorruptMetadataError) as e:
        from_hf(str(hf), str(tmp_path / "out"))
    text = str(e.value)
    assert "model-00001-of-00002.safetensors" in text and "model-00002-of-00002.safetensors" in text, text
    assert "'a'" in text and not (tmp_path / "out").exists()


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


# --- item 4: a storage's bytes, not its whole zip entry ---


def _local(name: bytes, crc: int, size: int) -> bytes:
    return struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, crc, size, size, len(name), 0) + name


def _central(name: bytes, crc: int, size: int, offset: int) -> bytes:
    fields = (b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, crc, size, size, len(name), 0, 0, 0, 0, 0, offset)
    return struct.pack("<4s6H3I5H2I", *fields) + name


def _sparse_zip(path: Path, entries: list[tuple[str, bytes, int]]) -> None:
    """A stored (uncompressed) zip of ``(name, first bytes, entry size)``: each entry's bytes past
    its first ones are zeros left as a hole in the file (nothing written); CRCs are real."""
    central, offset = [], 0
    with open(path, "wb") as f:
        for name, head, size in entries:
            crc = zlib.crc32(head)
            zeros = bytes(16 << 20)
            left = size - len(head)
            while left:
                crc = zlib.crc32(zeros[: min(left, len(zeros))], crc)
                left -= min(left, len(zeros))
            local = _local(name.encode(), crc, size)
            f.write(local + head)
            f.seek(offset + len(local) + size)
            central.append(_central(name.encode(), crc, size, offset))
            offset += len(local) + size
        cd = b"".join(central)
        f.write(cd + struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(cd), offset, 0))


def test_issue39_item4_a_storage_reads_its_bytes_not_its_whole_entry(tmp_path):
    """A rank file whose 4-byte storage sits in a 1 GiB zip entry: the whole entry was read and
    copied (over 2 GiB of Python buffers). Now the 4 bytes are read: peak traced memory stays
    under 1 MiB, and the value is the stored one."""
    with zipfile.ZipFile(io.BytesIO(_torch_save({"w": torch.tensor([1.5])}))) as z:
        names = [n for n in z.namelist() if not n.endswith("/data/0")]
        small = {n: z.read(n) for n in names}
        storage = next(n for n in z.namelist() if n.endswith("/data/0"))
        stored = z.read(storage)
    entries = [(n, data, len(data)) for n, data in small.items()] + [(storage, stored, 1 << 30)]
    _sparse_zip(tmp_path / "rank.pt", entries)
    tracemalloc.start()
    try:
        got = read_torch_save(str(tmp_path), "rank.pt", "test")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(got["w"], torch.tensor([1.5]))
    assert peak < 1 << 20, peak  # 2.0 GiB (2147536328 bytes) when the whole entry was read and copied


def test_issue39_item4_an_entry_compressed_in_its_local_header_is_refused(tmp_path):
    """The central directory says "stored", the entry's own header says "deflated": the bytes
    read would not be the storage's. Refused (read as raw bytes before)."""
    raw = bytearray(_torch_save({"w": torch.arange(4.0)}))
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as z:
        info = z.getinfo(next(n for n in z.namelist() if n.endswith("/data/0")))
    struct.pack_into("<H", raw, info.header_offset + 8, zipfile.ZIP_DEFLATED)
    (tmp_path / "rank.pt").write_bytes(bytes(raw))
    with pytest.raises(CorruptMetadataError, match="rank.pt.*data/0' is compressed"):
        read_torch_save(str(tmp_path), "rank.pt", "test")
