"""``unickpt convert --from dcp|hf`` on hostile folders (issue 26, items 2 and 6).

Each DCP folder starts as a real checkpoint written by ``torch.distributed.checkpoint`` in this
process; its ``.metadata`` is then edited through DCP's own classes and pickled again (or, for the
unpickler, written opcode by opcode). The expected outcome is always a refusal of a named
``CheckpointError`` subclass before any byte outside the folder is read, before anything is
allocated for a lie, and with nothing written to the output folder. FIFO cases run the import in
a thread joined with a timeout, so a hang fails the test (the FIFO is then opened for writing,
which releases the blocked reader).

Its tests that start processes are in ``tests/integration/tools/test_convert_hostile_processes.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import shutil
import stat
import threading
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path, PosixPath
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from unickpt.errors import (
    CheckpointError,
    CorruptMetadataError,
    SizeLimitError,
    StorageError,
    TruncatedDataFileError,
    UnsafePathError,
)
from unickpt.ops.convert import from_dcp, from_hf

W = torch.arange(12, dtype=torch.float32).reshape(3, 4)
B = torch.arange(5, dtype=torch.float64) * 0.5
OTHER = torch.full((3, 4), 7.0)  # the other folder's tensor: must never be imported


def _dcp_save(state: dict[str, Any], folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP checkpoint (``w``, ``b``, a non-tensor ``lr``) and, beside it, ``other/`` (``w``)."""
    root = tmp_path_factory.mktemp("dcp")
    _dcp_save({"w": W.clone(), "b": B.clone(), "lr": 0.25}, root / "src")
    _dcp_save({"w": OTHER.clone()}, root / "other")
    return root


@pytest.fixture
def case(saved: Path, tmp_path: Path) -> Path:
    """A fresh copy of ``saved`` under ``tmp_path``: ``src/`` is the folder each test spoils."""
    shutil.copytree(saved / "src", tmp_path / "src")
    shutil.copytree(saved / "other", tmp_path / "other")
    return tmp_path


def _edit(folder: Path, change: Callable[[Metadata], None]) -> None:
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written by DCP just now
    change(md)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _info(md: Metadata, key: str, offsets: tuple[int, ...] | None = None) -> _StorageInfo:
    return md.storage_data[MetadataIndex(key, offsets)]


def _refused(tmp: Path, error: type[BaseException], *words: str) -> str:
    with pytest.raises(error) as e:
        from_dcp(str(tmp / "src"), str(tmp / "ck"))
    assert isinstance(e.value, CheckpointError)
    for word in words:
        assert word in str(e.value), (word, str(e.value))
    assert not (tmp / "ck").exists()
    return str(e.value)


def _within(seconds: float, fifos: list[Path], fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn`` in a thread; fail the test if it is still blocked after ``seconds`` (then each
    FIFO is opened for writing and closed, which gives a reader blocked on it end-of-file)."""
    box: dict[str, BaseException | None] = {"error": None}

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for _ in range(100):  # a reader may open the FIFO again after end-of-file
            for fifo in fifos:
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
            thread.join(0.1)
            if not thread.is_alive():
                break
        pytest.fail(f"convert blocked on a FIFO for {seconds} s")
    return box["error"]


# --- item 2: DCP entries may only name regular files inside the folder ---


def test_dcp_entry_with_dotdot_or_absolute_path_is_refused(case):
    """``../other/__0_0.distcp`` and the absolute path of that file imported other's tensors."""
    target = case / "other" / "__0_0.distcp"
    for name in ("../other/__0_0.distcp", str(target)):
        _edit(case / "src", lambda md, n=name: setattr(_info(md, "w", (0, 0)), "relative_path", n))
        message = _refused(case, UnsafePathError, repr(name), "not a plain relative path")
        assert ".metadata" in message


def test_dcp_links_out_of_the_folder_are_refused(case):
    """A file link and a folder link leading to another checkpoint were followed."""
    src = case / "src"
    os.replace(src / "__0_0.distcp", src / "kept.distcp")
    os.symlink(case / "other" / "__0_0.distcp", src / "__0_0.distcp")
    _refused(case, UnsafePathError, "__0_0.distcp", "symbolic link")
    os.remove(src / "__0_0.distcp")
    os.replace(src / "kept.distcp", src / "__0_0.distcp")
    os.symlink(case / "other", src / "sub")
    _edit(src, lambda md: setattr(_info(md, "w", (0, 0)), "relative_path", "sub/__0_0.distcp"))
    _refused(case, UnsafePathError, "sub", "symbolic link")
    os.replace(src / ".metadata", src / "kept.metadata")
    os.symlink(case / "other" / ".metadata", src / ".metadata")
    _refused(case, UnsafePathError, ".metadata", "symbolic link")


def test_dcp_entry_that_cannot_be_opened_is_a_checkpoint_error(case):
    """A name the OS refuses to open (too long) or that goes through a file: a named error, not
    a raw OSError."""
    _edit(case / "src", lambda md: setattr(_info(md, "w", (0, 0)), "relative_path", "x" * 300))
    _refused(case, StorageError, "cannot open", "named by")
    _edit(case / "src", lambda md: setattr(_info(md, "w", (0, 0)), "relative_path", "__0_0.distcp/x"))
    _refused(case, UnsafePathError, "__0_0.distcp is a regular file where a folder belongs")


def test_bytecheckpoint_part_that_is_a_link_is_refused(case):
    """ByteCheckpoint's ``model/`` as a link to another checkpoint was followed and imported."""
    bcp = case / "bcp"
    bcp.mkdir()
    os.symlink(case / "other", bcp / "model")
    with pytest.raises(UnsafePathError, match="model is a symbolic link"):
        from_dcp(str(bcp), str(case / "ck"))
    assert not (case / "ck").exists()


def test_dcp_fifo_entry_is_refused_without_blocking(case):
    src = case / "src"
    os.replace(src / "__0_0.distcp", src / "data.distcp")
    _edit(src, lambda md: [setattr(i, "relative_path", "data.distcp") for i in md.storage_data.values()])
    os.mkfifo(src / "__0_0.distcp")
    _edit(src, lambda md: setattr(_info(md, "w", (0, 0)), "relative_path", "__0_0.distcp"))
    error = _within(60, [src / "__0_0.distcp"], lambda: from_dcp(str(src), str(case / "ck")))
    assert isinstance(error, UnsafePathError) and "a FIFO" in str(error), error
    assert not (case / "ck").exists()


def test_dcp_reads_are_bounded_by_the_file_size_before_allocating(case):
    """``/dev/zero`` (by name or by a link) with a 3 GiB length, and a regular file with a range
    past its end, are refused before any buffer of that size exists."""
    src = case / "src"
    huge = 3 << 30
    tracemalloc.start()
    try:
        _edit(src, lambda md: _info(md, "w", (0, 0)).__dict__.update(relative_path="/dev/zero", length=huge))
        _refused(case, UnsafePathError, "/dev/zero")
        os.symlink("/dev/zero", src / "zero.distcp")
        _edit(src, lambda md: setattr(_info(md, "w", (0, 0)), "relative_path", "zero.distcp"))
        _refused(case, UnsafePathError, "zero.distcp", "symbolic link")
        try:  # a device node inside the folder (needs CAP_MKNOD)
            os.mknod(src / "dev.distcp", stat.S_IFCHR | 0o600, os.makedev(1, 5))
        except OSError:
            pass
        else:
            _edit(src, lambda md: setattr(_info(md, "w", (0, 0)), "relative_path", "dev.distcp"))
            _refused(case, UnsafePathError, "dev.distcp", "a character device")
        _edit(src, lambda md: setattr(_info(md, "w", (0, 0)), "relative_path", "__0_0.distcp"))
        _refused(case, TruncatedDataFileError, "'w'", "__0_0.distcp", "which holds")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def test_dcp_chunk_needing_more_bytes_than_its_entry_holds_is_refused(case):
    _edit(case / "src", lambda md: setattr(_info(md, "w", (0, 0)), "length", 40))
    _refused(case, CorruptMetadataError, "'w'", "needs 48 bytes", "holds 40")


def test_dcp_entries_sharing_bytes_are_refused(case):
    """Two tensors read from one byte range: a small file could back any number of tensors."""

    def share(md: Metadata) -> None:
        md.state_dict_metadata["b"] = md.state_dict_metadata["w"]
        w = _info(md, "w", (0, 0))
        md.storage_data[MetadataIndex("b", (0, 0))] = _StorageInfo(w.relative_path, w.offset, w.length)

    _edit(case / "src", share)
    _refused(case, CorruptMetadataError, "share bytes", "'w'", "'b'")


def test_dcp_metadata_over_its_cap_is_refused_before_reading(case):
    """Today the whole cap (1 GiB) was read into memory first, then refused as corrupt."""
    from unickpt.ops.dcp_read import DCP_METADATA_LIMIT

    with open(case / "src" / ".metadata", "r+b") as f:
        f.truncate(DCP_METADATA_LIMIT + 1)  # sparse: nothing written
    tracemalloc.start()
    try:
        _refused(case, SizeLimitError, ".metadata", str(DCP_METADATA_LIMIT))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


# --- item 2: every tensor is tiled exactly by its chunks ---


@pytest.mark.parametrize(
    "chunks, words",
    [
        ([], ["not saved"]),
        ([((0, 0), (2, 4))], ["[2, 3) of dimension 0", "not saved"]),
        ([((0, 0), (3, 4)), ((1, 0), (2, 4))], ["overlap", "twice"]),
        ([((1, 0), (3, 4))], ["outside the shape"]),
    ],
    ids=["no-chunks", "half-covered", "overlapping", "outside"],
)
def test_dcp_tensor_not_tiled_by_its_chunks_is_refused(case, chunks, words):
    """Each of these imported ``torch.empty`` contents (heap memory) into the checkpoint."""

    def retile(md: Metadata) -> None:
        md.state_dict_metadata["w"].chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks]

    _edit(case / "src", retile)
    _refused(case, CorruptMetadataError, "tensor 'w'", "not tiled by its chunks", *words)


def test_dcp_tensor_of_two_chunks_is_assembled_and_a_missing_half_refused(tmp_path):
    """Two DCP tensors' storage entries re-described as the two row blocks of one tensor: the
    import is bit-exact; with the second block's storage entry gone, the tensor is refused (it
    was imported with uninitialised rows)."""
    src = tmp_path / "src"
    _dcp_save({"top": W[:2].clone(), "bottom": W[2:].clone()}, src)

    def join(md: Metadata) -> None:
        top = md.state_dict_metadata.pop("top")
        del md.state_dict_metadata["bottom"]
        top.size, top.chunks = (
            torch.Size((3, 4)),
            [
                ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((2, 4))),
                ChunkStorageMetadata(torch.Size((2, 0)), torch.Size((1, 4))),
            ],
        )
        md.state_dict_metadata["w"] = top
        md.storage_data = {
            MetadataIndex("w", (0, 0)): _info(md, "top", (0, 0)),
            MetadataIndex("w", (2, 0)): _info(md, "bottom", (0, 0)),
        }

    _edit(src, join)
    from_dcp(str(src), str(tmp_path / "ck"))
    from unickpt import FlatTensors, load

    got = FlatTensors({"model.w": torch.zeros(3, 4)})  # a bare state dict imports as the model
    load(str(tmp_path / "ck"), {"model": got})
    assert torch.equal(got["model.w"], W)
    shutil.rmtree(tmp_path / "ck")
    _edit(src, lambda md: md.storage_data.pop(MetadataIndex("w", (2, 0))))
    _refused(tmp_path, CorruptMetadataError, "tensor 'w'", "no storage entry", "(2, 0)")


# --- item 2: the allow-list unpickler gives state to DCP's records only ---


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _state(value: Any) -> bytes:
    return pickle.dumps(value, protocol=0)[:-1]  # the opcodes that push ``value`` (no STOP)


_ENUM = _global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING") + b"K\x00\x85R"
_HOSTILE = {
    # BUILD with (None, slot state): setattr on the class itself
    "class-attribute": (_global("pathlib", "PosixPath") + _state((None, {"poisoned": 1})), pathlib.PosixPath),
    "shared-class": (_global("collections", "OrderedDict") + _state((None, {"poisoned": 1})), None),
    # BUILD with a dict: the __dict__ of a shared function / enum member
    "function-dict": (_global("torch.serialization", "_get_layout") + _state({"poisoned": 1}), None),
    "enum-member": (_ENUM + _state({"poisoned": 1}), None),
}


@pytest.mark.parametrize("name", sorted(_HOSTILE))
def test_dcp_pickle_cannot_set_attributes_on_allowed_objects(tmp_path, name):
    """Today ``PosixPath.poisoned = 1`` (and the like) sticks for the whole process."""
    from collections import OrderedDict

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    ops, _ = _HOSTILE[name]
    targets = [pathlib.PosixPath, OrderedDict, torch.serialization._get_layout, _MEM_FORMAT_ENCODING(0)]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / ".metadata").write_bytes(b"\x80\x04" + ops + b"b.")
    try:
        _refused(tmp_path, CorruptMetadataError, "sets attributes on")
        assert not any("poisoned" in vars(t) for t in targets)
    finally:
        for t in targets:
            if "poisoned" in vars(t):
                delattr(t, "poisoned")


def test_dcp_pickle_gives_records_only_their_own_fields_of_their_types(case):
    """A DCP record given a field it does not have, or a field of the wrong type, is refused
    (today the first is kept on the object, the second fails with a raw TypeError)."""
    src = case / "src"
    _edit(src, lambda md: md.__dict__.update(evil=1))
    _refused(case, CorruptMetadataError, "Metadata", "'evil'")
    shutil.copy(case / "other" / ".metadata", src / ".metadata")  # a valid file again
    _edit(src, lambda md: setattr(md.state_dict_metadata["w"], "size", [3, "4"]))
    _refused(case, CorruptMetadataError, "tensor 'w'", "size")
    cycle: list[Any] = []
    cycle.append(cycle)
    _edit(src, lambda md: setattr(md.state_dict_metadata["w"], "size", torch.Size((3, 4))))
    _edit(src, lambda md: setattr(md, "planner_data", {"w": cycle, "x": [cycle, PosixPath("/")]}))
    _refused(case, CorruptMetadataError, "planner_data")  # a cycle is walked once, not forever


# --- item 6: Hugging Face folders ---


def _safetensors(folder: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    save_file(tensors, str(folder / name))


def _index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_hf_fifo_shard_is_refused_without_blocking(tmp_path):
    hf = tmp_path / "hf"
    _safetensors(hf, "model-00001-of-00002.safetensors", {"a": W})
    os.mkfifo(hf / "model-00002-of-00002.safetensors")
    _index(hf, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    fifo = hf / "model-00002-of-00002.safetensors"
    error = _within(60, [fifo], lambda: from_hf(str(hf), str(tmp_path / "ck")))
    assert isinstance(error, UnsafePathError) and "a FIFO" in str(error), error
    assert not (tmp_path / "ck").exists()


def test_hf_index_over_its_cap_is_refused_before_reading(tmp_path):
    from unickpt.ops.hf_read import HF_INDEX_LIMIT

    hf = tmp_path / "hf"
    _safetensors(hf, "model.safetensors", {"a": W})
    with open(hf / "model.safetensors.index.json", "wb") as f:
        f.truncate(HF_INDEX_LIMIT + 1)  # sparse: nothing written
    with pytest.raises(SizeLimitError, match=r"model\.safetensors\.index\.json.*" + str(HF_INDEX_LIMIT)):
        from_hf(str(hf), str(tmp_path / "ck"))


def test_hf_shards_outside_the_folder_are_refused(tmp_path):
    """A shard that is a link to another folder's file was imported; names leaving the folder
    are refused as unsafe paths."""
    _safetensors(tmp_path / "elsewhere", "secret.safetensors", {"a": OTHER})
    hf = tmp_path / "hf"
    hf.mkdir()
    os.symlink(tmp_path / "elsewhere" / "secret.safetensors", hf / "model-00001.safetensors")
    _index(hf, {"a": "model-00001.safetensors"})
    with pytest.raises(UnsafePathError, match="model-00001.safetensors.*symbolic link"):
        from_hf(str(hf), str(tmp_path / "ck"))
    for name in ("../elsewhere/secret.safetensors", str(tmp_path / "elsewhere" / "secret.safetensors")):
        _index(hf, {"a": name})
        with pytest.raises(UnsafePathError, match="not a plain relative path"):
            from_hf(str(hf), str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()


def test_hf_safetensors_header_is_bounded(tmp_path):
    """A header length over the cap, or past the end of the file, is refused as such (today a
    raw SafetensorError)."""
    from unickpt.ops.hf_read import SAFETENSORS_HEADER_LIMIT

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes((SAFETENSORS_HEADER_LIMIT + 1).to_bytes(8, "little") + b"{}")
    with pytest.raises(SizeLimitError, match=str(SAFETENSORS_HEADER_LIMIT)):
        from_hf(str(hf), str(tmp_path / "ck"))
    (hf / "model.safetensors").write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(CorruptMetadataError, match="1000 bytes"):
        from_hf(str(hf), str(tmp_path / "ck"))
