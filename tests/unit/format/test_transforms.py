"""``format.transforms.derive`` (pure): derived tensors built from saved shards read back exactly
the rows numpy slicing gives, for random tilings and random row ranges; every straddling piece
is verified against the whole saved shard's checksum; errors name the transform.

The expected values are numpy slices/concatenations of the full source arrays; the bytes are
read back by a tiny reader written here (whole saved shard, CRC32C, then the part), never by
unickpt's engine."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.errors import PlanningError
from unickpt.format.checksums import ChunkChecksums, chunk_crcs
from unickpt.format.records import Metadata, ShardRecord, TensorRecord, Topology
from unickpt.format.transforms import (
    Rows,
    RowsTensor,
    derive,
    fuse_rows,
    megatron_qkv_fuse,
    megatron_qkv_split,
    split_rows,
)


def _cuts(draw, n: int, most: int) -> list[int]:
    inner = draw(st.lists(st.integers(1, n - 1), max_size=most, unique=True)) if n > 1 else []
    return [0, *sorted(inner), n]


@st.composite
def saved(draw):
    """Sources of shape (rows, cols) with one shared cols, tiled into random row x col boxes,
    laid out in one byte string; the metadata and the arrays."""
    cols = draw(st.integers(1, 5))
    arrays, tensors, blob = {}, {}, bytearray()
    for i in range(draw(st.integers(1, 3))):
        rows = draw(st.integers(1, 12))
        a = np.arange(rows * cols, dtype=np.int32).reshape(rows, cols) + 1000 * i
        key = f"model.t{i}"
        arrays[key] = a
        shards = []
        rcuts, ccuts = _cuts(draw, rows, 3), _cuts(draw, cols, 2)
        for r0, r1 in zip(rcuts, rcuts[1:]):
            for c0, c1 in zip(ccuts, ccuts[1:]):
                data = np.ascontiguousarray(a[r0:r1, c0:c1]).tobytes()
                shards.append(ShardRecord((r0, c0), (r1 - r0, c1 - c0), 0, len(blob), len(data)))
                blob += data
                blob += b"\0" * (-len(blob) % 64)
        tensors[key] = TensorRecord(key, "int32", (rows, cols), tuple(shards))
    md = Metadata(3, "s", 0.0, Topology("torch", 1), ("f",), tensors, checksums=_sums(blob))
    return md, arrays, bytes(blob)


def _sums(blob: bytes | bytearray) -> ChunkChecksums:
    """Checksums of 64-byte chunks of the one data file ``blob`` (small, so that shards span
    several chunks and chunks several shards)."""
    return ChunkChecksums.from_files(64, [(len(blob), chunk_crcs([bytes(blob)], 64))])


def read_back(md: Metadata, key: str, blob: bytes) -> np.ndarray:
    """Assemble ``key`` from its shard records as a reader must: the checksum units covering each
    shard's bytes verified, then its bytes used."""
    rec = md.tensors[key]
    out = np.full(rec.shape, -1, dtype=np.int32)
    assert md.checksums is not None
    for s in rec.shards:
        units = md.checksums.cover(s.file_index, s.byte_offset, s.byte_offset + s.byte_length)
        assert units.lo <= s.byte_offset and s.byte_offset + s.byte_length <= units.hi
        for a, b, crc in zip(units.starts, units.ends, units.crcs):
            assert crc32c.crc32c(blob[a:b]) == crc
        part = blob[s.byte_offset : s.byte_offset + s.byte_length]
        box = np.frombuffer(part, dtype=np.int32).reshape(s.lengths)
        sl = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.lengths))
        assert (out[sl] == -1).all(), "two shards cover one element"
        out[sl] = box
    assert (out != -1).all(), "an element is not covered"
    return out


@settings(max_examples=examples(150), deadline=None)
@given(data=st.data())
def test_derived_tensors_read_back_as_numpy_slices(data):
    md, arrays, blob = data.draw(saved())
    keys = list(arrays)
    transforms, expected = [], {}
    for j in range(data.draw(st.integers(1, 3))):
        parts = []
        for _ in range(data.draw(st.integers(1, 4))):
            src = data.draw(st.sampled_from(keys))
            n = arrays[src].shape[0]
            a = data.draw(st.integers(0, n - 1))
            b = data.draw(st.integers(a + 1, n))
            parts.append(Rows(src, a, b))
        key = f"model.d{j}"
        transforms.append(RowsTensor(key, tuple(parts)))
        expected[key] = np.concatenate([arrays[p.source][p.start : p.stop] for p in parts])
    out = derive(md, transforms)
    for key, want in expected.items():
        assert np.array_equal(read_back(out, key, blob), want)
    used = {p.source for t in transforms for p in t.parts}
    assert set(out.tensors) == (set(keys) - used) | set(expected)


def test_fused_split_and_fuse_helpers_match_numpy():
    a = np.arange(9 * 4, dtype=np.int32).reshape(9, 4)
    shards, blob = [], bytearray()
    for r0, r1 in ((0, 4), (4, 9)):  # the boundary at 4 straddles q|k (3) and k|v (6)
        d = a[r0:r1].tobytes()
        shards.append(ShardRecord((r0, 0), (r1 - r0, 4), 0, len(blob), len(d)))
        blob += d
    md = Metadata(
        3,
        "s",
        0.0,
        Topology("torch", 1),
        ("f",),
        {"model.qkv": TensorRecord("model.qkv", "int32", (9, 4), tuple(shards))},
        checksums=_sums(blob),
    )
    out = derive(md, split_rows("model.qkv", [("model.q", 3), ("model.k", 3), ("model.v", 3)]))
    for i, k in enumerate(("model.q", "model.k", "model.v")):
        assert np.array_equal(read_back(out, k, bytes(blob)), a[3 * i : 3 * i + 3])
    # a derived tensor derived again still points into the saved bytes
    again = derive(out, [fuse_rows("model.kv", [("model.k", 3), ("model.v", 3)])])
    assert np.array_equal(read_back(again, "model.kv", bytes(blob)), a[3:9])


def test_megatron_interleaved_qkv_split_and_fuse_match_numpy():
    groups, hpg, hd, cols = 2, 3, 2, 4
    rows = groups * (hpg + 2) * hd
    w = np.arange(rows * cols, dtype=np.int32).reshape(rows, cols)
    blob = w.tobytes()
    rec = TensorRecord("model.qkv", "int32", (rows, cols), (ShardRecord((0, 0), (rows, cols), 0, 0, len(blob)),))
    md = Metadata(3, "s", 0.0, Topology("torch", 1), ("f",), {"model.qkv": rec}, checksums=_sums(blob))
    out = derive(
        md,
        megatron_qkv_split(
            "model.qkv", "model.q", "model.k", "model.v", num_query_groups=groups, heads_per_group=hpg, head_dim=hd
        ),
    )
    g = w.reshape(groups, hpg + 2, hd, cols)  # Megatron's layout per query group: q heads, k, v
    assert np.array_equal(read_back(out, "model.q", blob), g[:, :hpg].reshape(-1, cols))
    assert np.array_equal(read_back(out, "model.k", blob), g[:, hpg].reshape(-1, cols))
    assert np.array_equal(read_back(out, "model.v", blob), g[:, hpg + 1].reshape(-1, cols))
    back = derive(
        out,
        [
            megatron_qkv_fuse(
                "model.qkv2", "model.q", "model.k", "model.v", num_query_groups=groups, heads_per_group=hpg, head_dim=hd
            )
        ],
    )
    assert np.array_equal(read_back(back, "model.qkv2", blob), w)


def _one(shape=(6, 2), dtype="int32", key="model.a"):
    n = int(np.prod(shape)) * 4
    return TensorRecord(key, dtype, shape, (ShardRecord((0,) * len(shape), shape, 0, 0, n),))


@pytest.mark.parametrize(
    "transforms,words",
    [
        ([RowsTensor("model.x", (Rows("model.nope", 0, 1),))], "no tensor 'model.nope'"),
        ([RowsTensor("model.x", (Rows("model.a", 4, 7),))], "rows [4, 7) are not inside"),
        ([RowsTensor("model.x", (Rows("model.a", 0, 2), Rows("model.b", 0, 1)))], "parts must agree"),
        ([RowsTensor("model.b", (Rows("model.a", 0, 2),))], "has a tensor of that name already"),
        (
            [RowsTensor("model.x", (Rows("model.a", 0, 1),)), RowsTensor("model.x", (Rows("model.a", 1, 2),))],
            "two transforms derive",
        ),
        ([RowsTensor("model.x", ())], "at least one part"),
    ],
)
def test_bad_transforms_are_refused_by_name(transforms, words):
    md = Metadata(
        2, "s", 0.0, Topology("torch", 1), ("f",), {"model.a": _one(), "model.b": _one((6, 3), key="model.b")}
    )
    with pytest.raises(PlanningError) as e:
        derive(md, transforms)
    assert words in str(e.value)
