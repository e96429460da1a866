"""Metadata codec: encode/decode round trips and validation of every impossible record.

Each rejection must be a CorruptMetadataError (or UnsupportedFormatVersionError) whose message
names the offending tensor, blob or file, so a user can tell what is broken.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.fixtures.format_sums import chunk_sums
from unickpt.errors import CorruptMetadataError, UnsupportedFormatVersionError
from unickpt.format import (
    FORMAT_VERSION,
    BlobRecord,
    Metadata,
    ShardRecord,
    TensorRecord,
    Topology,
    decode_metadata,
    encode_metadata,
)
from unickpt.format.checksums import ChunkChecksums

FILES = ("data/s1/r00000-00.bin", "data/s1/r00001-00.bin")


def sample() -> Metadata:
    """Two ranks: a 2-D tensor split by rows over both files, a 0-d tensor, a bf16 vector, blobs."""
    w = TensorRecord(
        "model.w",
        "float32",
        (5, 3),
        (
            ShardRecord((0, 0), (3, 3), 0, 0, 36),
            ShardRecord((3, 0), (2, 3), 1, 0, 24),
        ),
    )
    scalar = TensorRecord("optimizer.state.w.step", "float32", (), (ShardRecord((), (), 0, 36, 4),))
    half = TensorRecord("model.b", "bfloat16", (4,), (ShardRecord((0,), (4,), 1, 24, 8),))
    empty = TensorRecord("model.empty", "int64", (0, 4), (ShardRecord((0, 0), (0, 4), 1, 32, 0),))
    return Metadata(
        format_version=FORMAT_VERSION,
        save_id="s1",
        created_unix=1700000000.25,
        topology=Topology("fsdp2", 2, (("dp", 2),)),
        files=FILES,
        tensors={t.fqn: t for t in (w, scalar, half, empty)},
        objects={"optimizer": {"param_groups": [{"lr": 0.01, "params": ["w"]}]}},
        blobs={
            "extra_state/rank0": BlobRecord("extra_state/rank0", 0, 40, 17),
            "extra_state/rank1": BlobRecord("extra_state/rank1", 1, 32, 17),
        },
        role="actor",
        # file 0 ends with blob rank0 at 57, file 1 with blob rank1 at 49: one chunk each
        checksums=ChunkChecksums.from_files(4096, [(57, [123]), (49, [0xFFFFFFFF])]),
    )


def doc() -> dict[str, Any]:
    return json.loads(encode_metadata(sample()))


def decode(d: dict[str, Any]) -> Metadata:
    return decode_metadata(json.dumps(d).encode(), "ckpt/unickpt.metadata.json")


def test_round_trip_is_identity() -> None:
    md = sample()
    data = encode_metadata(md)
    assert decode_metadata(data) == md
    assert encode_metadata(decode_metadata(data)) == data  # stable bytes


def test_round_trip_without_optional_fields() -> None:
    md = Metadata(FORMAT_VERSION, "x", 0.0, Topology("torch", 1), (), {}, checksums=ChunkChecksums(1 << 20, (), b""))
    assert decode_metadata(encode_metadata(md)) == md


def test_encoding_is_compact_json_without_pickle() -> None:
    data = encode_metadata(sample())
    text = data.decode("utf-8")
    assert json.loads(text)["magic"] == "unickpt"
    assert " " not in text.split('"objects"')[0]  # separators without spaces
    assert json.loads(text)["tensors"]["model.w"]["shards"][0] == [0, 0, 3, 3, 0, 0]  # no length, no checksum
    assert json.loads(text)["checksums"]["file_sizes"] == [57, 49]


def test_total_tensor_bytes() -> None:
    assert sample().total_tensor_bytes == 36 + 24 + 4 + 8


_STEP = "optimizer.state.w.step"


def _shard(d: dict[str, Any], fqn: str = "model.w", i: int = 0) -> list[Any]:
    return d["tensors"][fqn]["shards"][i]


def _set(fn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    d = doc()
    fn(d)
    return d


BAD: dict[str, tuple[Callable[[dict[str, Any]], None], list[str]]] = {
    # shard box [3, 0]+[3, 3] pokes out of the 5 rows
    "shard outside the shape": (lambda d: _shard(d, i=1).__setitem__(2, 3), ["model.w", "outside"]),
    "range past the file's end": (lambda d: _shard(d, i=1).__setitem__(5, 49), ["model.w", "ends past the 49 bytes"]),
    "overlapping byte ranges": (lambda d: _shard(d, "model.b").__setitem__(3, 20), ["overlap", "model.b"]),
    "file index out of range": (lambda d: _shard(d).__setitem__(4, 2), ["model.w", "file #2"]),
    "negative offset": (lambda d: _shard(d).__setitem__(0, -1), ["model.w", "-1"]),
    "negative shape": (lambda d: d["tensors"]["model.w"].__setitem__("shape", [-5, 3]), ["model.w", "-5"]),
    "float field": (lambda d: _shard(d).__setitem__(5, 0.5), ["model.w", "0.5"]),
    "string field": (lambda d: _shard(d).__setitem__(5, "0"), ["model.w", "'0'"]),
    "bool field": (lambda d: _shard(d).__setitem__(5, True), ["model.w", "True"]),
    "non-string dtype": (lambda d: d["tensors"]["model.b"].__setitem__("dtype", 4), ["model.b", "dtype"]),
    "too few checksums": (lambda d: d["checksums"].__setitem__("crcs", "AAAAAA=="), ["checksums.crcs"]),
    "checksums not base64": (lambda d: d["checksums"].__setitem__("crcs", "!!!!!!!!!!!!"), ["base64"]),
    "unknown checksum": (lambda d: d["checksums"].__setitem__("algorithm", "md5"), ["'md5'"]),
    "tiny chunk size": (lambda d: d["checksums"].__setitem__("chunk_size", 1), ["chunk_size"]),
    "file sizes per file": (lambda d: d["checksums"]["file_sizes"].pop(), ["1 sizes for 2 files"]),
    "negative file size": (lambda d: d["checksums"]["file_sizes"].__setitem__(0, -1), ["file_sizes"]),
    "missing checksums": (lambda d: d.pop("checksums"), ["checksums"]),
    "shard row too short": (lambda d: _shard(d).pop(), ["model.w", "wrong length"]),
    "shards leave a gap": (lambda d: d["tensors"]["model.w"]["shards"].pop(1), ["model.w", "cover"]),
    "shards overlap in the tensor": (lambda d: _shard(d, i=1).__setitem__(0, 2), ["model.w", "(2, 0)+(2, 3)"]),
    "blob file index": (lambda d: d["blobs"]["extra_state/rank0"].__setitem__(0, 9), ["extra_state/rank0", "#9"]),
    "blob overlaps tensor": (
        lambda d: d["blobs"]["extra_state/rank0"].__setitem__(1, 30),
        ["extra_state/rank0", "overlap"],
    ),
    "parent traversal": (lambda d: d["files"].__setitem__(0, "../x"), ["'../x'", "escapes"]),
    "nested traversal": (lambda d: d["files"].__setitem__(0, "data/../../x"), ["data/../../x", "escapes"]),
    "absolute file name": (lambda d: d["files"].__setitem__(0, "/abs"), ["'/abs'", "escapes"]),
    "backslash file name": (lambda d: d["files"].__setitem__(0, "..\\x"), ["escapes"]),
    "empty file name": (lambda d: d["files"].__setitem__(0, ""), ["''", "escapes"]),
    "world size zero": (lambda d: d["topology"].__setitem__("world_size", 0), ["world_size"]),
    "missing tensors": (lambda d: d.pop("tensors"), ["tensors"]),
    # 0-d tensors take the decoder's scalar shortcut; the same rows are refused by name
    "scalar file index": (lambda d: _shard(d, _STEP).__setitem__(0, 2), [_STEP, "file #2"]),
    "scalar bool offset": (lambda d: _shard(d, _STEP).__setitem__(1, True), [_STEP, "True"]),
    "scalar negative offset": (lambda d: _shard(d, _STEP).__setitem__(1, -4), [_STEP, "-4"]),
    "scalar past the file's end": (lambda d: _shard(d, _STEP).__setitem__(1, 100), [_STEP, "ends past the 57 bytes"]),
    "scalar row too long": (lambda d: _shard(d, _STEP).append(0), [_STEP, "wrong length"]),
    "scalar with two rows": (lambda d: d["tensors"][_STEP]["shards"].append([1, 40]), [_STEP]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_rejects(case: str) -> None:
    mutate, words = BAD[case]
    with pytest.raises(CorruptMetadataError) as info:
        decode(_set(mutate))
    msg = str(info.value)
    assert "ckpt/unickpt.metadata.json" in msg  # names the metadata file
    for w in words:
        assert w in msg, (case, msg)


def test_unknown_dtype_is_corrupt_metadata() -> None:
    with pytest.raises(CorruptMetadataError, match="float7"):
        decode(_set(lambda d: d["tensors"]["model.b"].__setitem__("dtype", "float7")))


def test_unknown_dtype_message_names_tensor_and_file() -> None:
    with pytest.raises(CorruptMetadataError) as info:
        decode(_set(lambda d: d["tensors"]["model.b"].__setitem__("dtype", "float7")))
    assert "model.b" in str(info.value) and "ckpt/unickpt.metadata.json" in str(info.value)


def test_rejects_unsupported_format_version() -> None:
    with pytest.raises(UnsupportedFormatVersionError, match=r"ckpt/unickpt.metadata.json.*version 99"):
        decode(_set(lambda d: d.__setitem__("format_version", 99)))


@pytest.mark.parametrize("version", [0, -1])
def test_rejects_impossible_format_version(version: int) -> None:
    with pytest.raises(UnsupportedFormatVersionError):
        decode(_set(lambda d: d.__setitem__("format_version", version)))


@pytest.mark.parametrize("data", [b"", b"\x00\xff garbage", b'{"magic": "unickpt", "format_', b"[]", b"null"])
def test_rejects_garbage_and_truncated_json(data: bytes) -> None:
    with pytest.raises(CorruptMetadataError, match="ckpt/unickpt.metadata.json"):
        decode_metadata(data, "ckpt/unickpt.metadata.json")


def test_rejects_truncated_real_metadata() -> None:
    data = encode_metadata(sample())
    with pytest.raises(CorruptMetadataError, match="not valid JSON"):
        decode_metadata(data[: len(data) // 2])


def test_rejects_foreign_json() -> None:
    with pytest.raises(CorruptMetadataError, match="magic"):
        decode_metadata(json.dumps({"format_version": 1, "state_dict_metadata": {}}).encode())


def test_rejects_non_integer_version() -> None:
    with pytest.raises(CorruptMetadataError, match="format_version"):
        decode(_set(lambda d: d.__setitem__("format_version", "1")))


def test_adjacent_byte_ranges_are_fine() -> None:
    md = decode(doc())  # the sample packs ranges back to back in both files
    assert (
        md.tensors["model.w"].shards[0].byte_offset + 36 == md.tensors["optimizer.state.w.step"].shards[0].byte_offset
    )


# --- binary shard tables (tensors with many shards) --------------------------------------------


def _many_shards_md(rows: int = 100) -> Metadata:
    from unickpt.format.codec import TABLE_FROM

    assert rows >= TABLE_FROM
    shards = tuple(ShardRecord((r * 2, 0), (2, 3), r % 4, r * 64, 24) for r in range(rows))
    rec = TensorRecord("model.big", "float32", (2 * rows, 3), shards)
    files = tuple(f"data/s/r{r:05d}-00.bin" for r in range(4))
    return Metadata(3, "sid", 1.0, Topology("fsdp2", 4), files, {"model.big": rec}, checksums=chunk_sums(files, [rec]))


def test_binary_shard_table_round_trip():
    import json as _json

    md = _many_shards_md()
    raw = encode_metadata(md)
    assert "shard_table" in _json.loads(raw)["tensors"]["model.big"]
    assert decode_metadata(raw) == md


@pytest.mark.parametrize(
    "corrupt, words",
    [
        (lambda a: a.__setitem__((5, 0), -1), ["model.big", "row 5", "negative"]),
        (lambda a: a.__setitem__((7, 0), 10**6), ["model.big", "row 7", "outside"]),
        (lambda a: a.__setitem__((3, 4), 99), ["model.big", "row 3", "file index"]),
        (lambda a: a.__setitem__((9, 5), 1 << 20), ["model.big", "ends past"]),
        (lambda a: a.__setitem__((4, 0), 6), ["model.big", "overlap"]),
    ],
)
def test_binary_shard_table_rejects_bad_rows(corrupt, words):
    import base64
    import json as _json

    import numpy as np

    doc = _json.loads(encode_metadata(_many_shards_md()))
    entry = doc["tensors"]["model.big"]
    arr = np.frombuffer(base64.b64decode(entry["shard_table"]), dtype="<i8").reshape(-1, 6).copy()
    corrupt(arr)
    entry["shard_table"] = base64.b64encode(arr.astype("<i8").tobytes()).decode()
    with pytest.raises(CorruptMetadataError) as ei:
        decode_metadata(_json.dumps(doc).encode(), "ck/unickpt.metadata.json")
    for w in words:
        assert w in str(ei.value)


@pytest.mark.parametrize("table", ["not base64!", "AAAA", 12])
def test_binary_shard_table_rejects_bad_encoding(table):
    import json as _json

    doc = _json.loads(encode_metadata(_many_shards_md()))
    doc["tensors"]["model.big"]["shard_table"] = table
    with pytest.raises(CorruptMetadataError, match="model.big"):
        decode_metadata(_json.dumps(doc).encode())
