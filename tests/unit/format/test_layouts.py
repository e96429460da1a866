"""Regular layouts (``format.layouts``): tensors split the same way over many files, described
once. Their shards, computed on demand, equal rows written out by hand; they round-trip through
the codec; overlap queries match a scan; and every inconsistency is refused by name."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.format_sums import chunk_sums
from tests.support.hypothesis_profiles import examples
from unickpt.errors import CorruptMetadataError
from unickpt.format import Metadata, ShardRecord, TensorRecord, Topology, decode_metadata, encode_metadata
from unickpt.format.layouts import SplitLayout, SplitShards
from unickpt.format.validation import validate_metadata
from unickpt.planning.load.shards import ShardIndex, scan_overlapping

SETTINGS = settings(max_examples=examples(150), deadline=None, derandomize=True, database=None)


def _hand_rows(entries, parts, files):
    """Oracle: the shard rows a writer would list, from torch.chunk's rule and the byte layout
    (each chunk at the next 64-byte boundary of its file), written out plainly."""
    out = {}
    for p in range(parts):
        pos = 0
        for fqn, isz, shape, d in entries:
            n = shape[d]
            c = -(-n // parts)
            lo = min(n, p * c)
            rows = min(n, lo + c) - lo
            offs = tuple(lo if i == d else 0 for i in range(len(shape)))
            lens = tuple(rows if i == d else s for i, s in enumerate(shape))
            nbytes = math.prod(lens) * isz
            out.setdefault(fqn, []).append(ShardRecord(offs, lens, files[p], pos, nbytes))
            pos += -(-nbytes // 64) * 64
    return out


@st.composite
def layouts(draw):
    parts = draw(st.integers(1, 20))  # SplitShards keep records up to 16 parts: both paths
    entries = []
    for i in range(draw(st.integers(1, 5))):
        shape = tuple(draw(st.lists(st.integers(0, 12), min_size=1, max_size=3)))
        d = draw(st.integers(0, len(shape) - 1))
        entries.append((f"model.t{i}", draw(st.sampled_from([1, 2, 4])), shape, d))
    files = tuple(draw(st.permutations(range(parts + 2)))[:parts])
    return SplitLayout(files, tuple(entries))


@SETTINGS
@given(layouts())
def test_split_shards_are_the_rows_a_writer_would_list(lay: SplitLayout) -> None:
    want = _hand_rows(lay.entries, lay.parts, lay.files)
    for e, (fqn, *_rest) in enumerate(lay.entries):
        got = SplitShards(lay, e)
        assert list(got) == want[fqn] and len(got) == lay.parts
        assert [got[i] for i in range(lay.parts)] == want[fqn]
        # the lookups without records: location and bytes per row (of the hand-made rows)
        isz = lay.entries[e][1]
        for i, row in enumerate(want[fqn]):
            assert got.location(i) == (row.file_index, row.byte_offset, row.byte_length)
            assert got.row_bytes(i) == math.prod(row.lengths[1:]) * isz
    ends = lay.ends().tolist()
    for p in range(lay.parts):  # each file's layout bytes end where its last non-empty chunk ends
        held = [want[fqn][p] for fqn, *_ in lay.entries if want[fqn][p].byte_length]
        assert ends[p] == (held[-1].byte_offset + held[-1].byte_length if held else 0)


@SETTINGS
@given(layouts(), st.data())
def test_parts_a_box_touches_are_the_scan(lay: SplitLayout, data) -> None:
    e = data.draw(st.integers(0, len(lay.entries) - 1))
    _, _, shape, _ = lay.entries[e]
    offs = tuple(data.draw(st.integers(0, s)) for s in shape)
    lens = tuple(data.draw(st.integers(0, s - o)) for s, o in zip(shape, offs))
    shards = SplitShards(lay, e)
    assert shards.overlapping(offs, lens) == scan_overlapping(list(shards), offs, lens)


@SETTINGS
@given(layouts(), st.data())
def test_the_part_a_box_is_exactly_is_the_scan(lay: SplitLayout, data) -> None:
    """``exact_part``: the one part whose (non-empty) box is the queried box, with the record a
    writer would list for it; None when no part's is. Queried with every part's own box, and
    with random boxes (in, out of and sticking out of the shape; of another rank)."""
    e = data.draw(st.integers(0, len(lay.entries) - 1))
    fqn, _, shape, _ = lay.entries[e]
    rows = _hand_rows(lay.entries, lay.parts, lay.files)[fqn]
    boxes = [(r.offsets, r.lengths) for r in rows]
    for _ in range(4):
        nd = data.draw(st.sampled_from([len(shape), len(shape), len(shape) + 1, max(0, len(shape) - 1)]))
        offs = tuple(data.draw(st.integers(-1, 13)) for _ in range(nd))
        lens = tuple(data.draw(st.integers(0, 13)) for _ in range(nd))
        boxes.append((offs, lens))
    shards = SplitShards(lay, e)
    for offs, lens in boxes:
        want = [(i, r) for i, r in enumerate(rows) if (r.offsets, r.lengths) == (offs, lens) and math.prod(lens) > 0]
        got = shards.exact_part(offs, lens)
        assert got == (want[0] if want else None)


def _md(lay: SplitLayout, extra_rows: dict | None = None) -> Metadata:
    nfiles = max(lay.files) + 1
    files = tuple(f"data/s/r{i:05d}-00.bin" for i in range(nfiles))
    dtypes = {1: "uint8", 2: "bfloat16", 4: "float32"}
    tensors = {
        fqn: TensorRecord(fqn, dtypes[isz], shape, SplitShards(lay, e))
        for e, (fqn, isz, shape, _) in enumerate(lay.entries)
    }
    tensors.update(extra_rows or {})
    return Metadata(
        3, "s", 1.0, Topology("fsdp2", lay.parts), files, tensors, checksums=chunk_sums(files, tensors.values())
    )


@SETTINGS
@given(layouts())
def test_layouts_round_trip_and_decode_as_shards(lay: SplitLayout) -> None:
    md = _md(lay)
    validate_metadata(md)
    raw = encode_metadata(md)
    doc = json.loads(raw)
    assert len(doc["layouts"]) == 1 and all("shards" not in t for t in doc["tensors"].values())
    back = decode_metadata(raw)
    for fqn, rec in md.tensors.items():
        assert isinstance(back.tensors[fqn].shards, SplitShards)
        assert list(back.tensors[fqn].shards) == list(rec.shards)
    index = ShardIndex(back)
    for fqn, rec in back.tensors.items():
        whole = ((0,) * len(rec.shape), rec.shape)
        assert index.overlapping(fqn, *whole) == scan_overlapping(list(rec.shards), *whole)


def test_metadata_grows_with_tensors_not_files() -> None:
    entries = tuple((f"model.t{i}", 4, (4096, 64), 0) for i in range(20))
    small = len(encode_metadata(_md(SplitLayout(tuple(range(8)), entries))))
    big = len(encode_metadata(_md(SplitLayout(tuple(range(1024)), entries))))
    # 128x the files: only the file list and the checksums grow (a few bytes per file)
    assert big - small < 1024 * 40


def _doc(lay: SplitLayout) -> dict:
    return json.loads(encode_metadata(_md(lay)))


LAY = SplitLayout((0, 1, 2), (("model.a", 4, (6, 4), 0), ("model.b", 4, (5,), 0)))


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda d: d["layouts"][0]["entries"].pop(), ["'model.b' names layout 0, which does not list it"]),
        (lambda d: d["layouts"][0]["entries"][0].__setitem__(1, 2), ["dimension 2 of a rank-2 tensor"]),
        (lambda d: d["layouts"][0]["files"].__setitem__(1, 0), ["each once"]),
        (lambda d: d["layouts"][0]["files"].__setitem__(1, 9), ["file index"]),
        (lambda d: d["tensors"]["model.a"].__setitem__("layout", 3), ["layout"]),
        (lambda d: d["layouts"].append(d["layouts"][0]), ["also belongs to layout 0"]),
        (lambda d: d["checksums"]["file_sizes"].__setitem__(0, 8), ["ends past", "data/s/r00000-00.bin"]),
        (lambda d: d["layouts"][0]["entries"].append(["model.a", 0]), ["listed twice"]),
        (lambda d: d["tensors"]["model.a"].__setitem__("shape", []), ["1 to 64 dimensions"]),
        # what the decoder's inline check of plain entries passes on to the full parse
        (lambda d: d["tensors"]["model.a"].__setitem__("layout", True), ["'model.a' layout", "True"]),
        (lambda d: d["tensors"]["model.a"]["shape"].__setitem__(0, True), ["'model.a' shape", "True"]),
        (lambda d: d["tensors"]["model.a"]["shape"].__setitem__(0, -3), ["'model.a' shape", "-3"]),
        (lambda d: d["tensors"]["model.a"].__setitem__("dtype", 4), ["'model.a'", "dtype must be a string"]),
        (lambda d: d["tensors"]["model.a"].__setitem__("dtype", "float99"), ["'model.a'", "unknown dtype"]),
        (lambda d: d["layouts"][0]["entries"][0].__setitem__(1, True), ["layout 0: dimension", "True"]),
        (lambda d: d["layouts"][0]["entries"][0].__setitem__(1, -1), ["layout 0: dimension", "-1"]),
    ],
)
def test_inconsistent_layouts_are_refused_by_name(mutate, words) -> None:
    doc = _doc(LAY)
    mutate(doc)
    with pytest.raises(CorruptMetadataError) as info:
        decode_metadata(json.dumps(doc).encode(), "ck")
    for w in words:
        assert w in str(info.value), str(info.value)


def test_a_row_inside_a_layout_region_is_an_overlap() -> None:
    extra = {"model.c": TensorRecord("model.c", "float32", (2,), (ShardRecord((0,), (2,), 0, 64, 8),))}
    with pytest.raises(CorruptMetadataError, match="byte ranges of 'layout 0' and 'model.c' overlap"):
        decode_metadata(encode_metadata(_md(LAY, extra)), "ck")
    after = {"model.c": TensorRecord("model.c", "float32", (2,), (ShardRecord((0,), (2,), 0, 256, 8),))}
    back = decode_metadata(encode_metadata(_md(LAY, after)), "ck")  # past the layout's bytes: fine
    assert back.tensors["model.c"].shards[0].byte_offset == 256
