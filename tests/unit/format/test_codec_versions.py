"""format.codec's version table and format.sections: how the format evolves.

A worked example section (``SamplerState``, defined here, not in unickpt) proves the section
mechanism end to end: version-2 documents written and read by a codec that knows it, refused
(required) or skipped with a warning (optional) by one that does not, refused with an upgrade
hint by an unickpt that reads only version 1. A test-only version 3 (compact rows for even
splits, the kind of change the scale issue needs) is added to a codec object without touching
versions 1 and 2. Expected documents are written out here, never produced by the code under test.
"""

from __future__ import annotations

import base64
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest

from tests.fixtures.golden_v1 import GOLDEN
from unickpt.errors import (
    CorruptMetadataError,
    SizeLimitError,
    UnsupportedFormatVersionError,
    UnsupportedValueError,
)
from unickpt.format import (
    DEFAULT_CODEC,
    FORMAT_VERSION,
    METADATA_FILE,
    READERS,
    WRITERS,
    Metadata,
    MetadataCodec,
    SectionCodec,
    SectionRegistry,
    SectionWarning,
    ShardRecord,
    TensorRecord,
    Topology,
    decode_metadata,
    encode_metadata,
    v1,
    v2,
    v3,
)
from unickpt.format.checksums import RangeChecksums

# --------------------------------------------------------------------------- the worked example section


@dataclass(frozen=True, slots=True)
class SamplerState:
    """What a feature might index in the metadata: an epoch and one position per DP rank."""

    epoch: int
    positions: tuple[int, ...]


def _sampler_encode(s: SamplerState) -> Any:
    return {"epoch": s.epoch, "positions": list(s.positions)}


def _sampler_decode(data: Any, version: int) -> SamplerState:
    if not isinstance(data, dict) or set(data) != {"epoch", "positions"}:
        raise CorruptMetadataError("sampler state must be {epoch, positions}")
    epoch, positions = data["epoch"], data["positions"]
    if type(epoch) is not int or epoch < 0 or not isinstance(positions, list) or len(positions) > 4096:
        raise CorruptMetadataError("sampler state: bad epoch or positions")
    if not all(type(p) is int and p >= 0 for p in positions):
        raise CorruptMetadataError("sampler state: positions must be non-negative integers")
    return SamplerState(epoch, tuple(positions))


def sampler_codec(**changes: Any) -> SectionCodec[SamplerState]:
    fields: dict[str, Any] = dict(
        name="sampler", record_type=SamplerState, encode=_sampler_encode, decode=_sampler_decode, max_bytes=1 << 16
    )
    fields.update(changes)
    return SectionCodec(**fields)


def codec_with(*section_codecs: SectionCodec[Any]) -> MetadataCodec:
    return MetadataCodec(sections=SectionRegistry(section_codecs))


def base_md(crcs: Callable[[int], int] = lambda i: 5, **changes: Any) -> Metadata:
    """Metadata with one checksum per shard (versions 1 and 2): shard i's is ``crcs(i)``."""
    w = TensorRecord("model.w", "float32", (2, 2), (ShardRecord((0, 0), (2, 2), 0, 0, 16),))
    fields: dict[str, Any] = dict(
        format_version=1,
        save_id="s1",
        created_unix=1700000000.5,
        topology=Topology("torch", 1),
        files=("data/s1/r00000-00.bin",),
        tensors={"model.w": w},
    )
    fields.update(changes)
    shards = [s for t in fields["tensors"].values() for s in t.shards]
    units = tuple((s.file_index, s.byte_offset, s.byte_length, crcs(i)) for i, s in enumerate(shards))
    fields.setdefault("checksums", RangeChecksums(units))
    return Metadata(**fields)


STATE = SamplerState(3, (10, 20))
V1_BYTES = (
    b'{"magic":"unickpt","format_version":1,"save_id":"s1","created_unix":1700000000.5,"role":null,'
    b'"topology":{"framework":"torch","world_size":1,"mesh":[]},"files":["data/s1/r00000-00.bin"],'
    b'"tensors":{"model.w":{"dtype":"float32","shape":[2,2],"shards":[[0,0,2,2,0,0,16,5]]}},'
    b'"objects":{},"blobs":{}}'
)
V2_BYTES = (
    V1_BYTES[:-1].replace(b'"format_version":1', b'"format_version":2')
    + b',"sections":{"sampler":{"version":1,"required":true,"data":{"epoch":3,"positions":[10,20]}}}}'
)


# --------------------------------------------------------------------------- the version table


def test_issue11_reader_table_dispatches_on_format_version() -> None:
    assert dict(READERS) == {1: v1.READER, 2: v2.READER, 3: v3.READER}
    assert dict(WRITERS) == {1: v1.WRITER, 2: v2.WRITER, 3: v3.WRITER}
    assert FORMAT_VERSION == max(READERS) == DEFAULT_CODEC.newest == 3
    assert decode_metadata(V1_BYTES).format_version == 1
    with pytest.raises(UnsupportedFormatVersionError, match=r"format version 4; this unickpt reads versions 1..3"):
        decode_metadata(V1_BYTES.replace(b'"format_version":1', b'"format_version":4'), "ck")


def test_issue11_metadata_without_sections_stays_version_1_byte_for_byte() -> None:
    assert encode_metadata(base_md()) == V1_BYTES
    for name in ("v1_fsdp2_ws3", "v1_table"):  # the golden checkpoints re-encode to their own bytes
        raw = open(os.path.join(GOLDEN, name, METADATA_FILE), "rb").read()
        assert encode_metadata(decode_metadata(raw)) == raw, name


def test_format_version_of_a_record_is_the_floor_to_write() -> None:
    """A record may ask for a newer version than its content needs (2 without sections: an empty
    sections object); never for one this unickpt cannot write."""
    md = base_md(format_version=2)
    raw = encode_metadata(md)
    assert json.loads(raw)["sections"] == {} and decode_metadata(raw) == md
    with pytest.raises(UnsupportedFormatVersionError, match="cannot write format version 9"):
        encode_metadata(base_md(format_version=9))


def test_released_versions_cannot_be_redefined() -> None:
    with pytest.raises(ValueError, match="already defined"):
        DEFAULT_CODEC.with_version(1, v2.READER)


# --------------------------------------------------------------------------- sections


def test_issue11_section_needs_version_2_and_round_trips() -> None:
    codec = codec_with(sampler_codec())
    md = base_md(sections={"sampler": STATE})
    raw = codec.encode(md)
    assert raw == V2_BYTES
    back = codec.decode(raw, "ck")
    assert back == replace(md, format_version=2) and back.sections["sampler"] == STATE


def test_issue11_unknown_required_section_is_refused_with_an_upgrade_hint() -> None:
    with pytest.raises(UnsupportedFormatVersionError) as info:
        decode_metadata(V2_BYTES, "ck/unickpt.metadata.json")
    msg = str(info.value)
    assert "ck/unickpt.metadata.json" in msg and "'sampler'" in msg and "Upgrade unickpt" in msg


def test_issue11_unknown_optional_section_is_skipped_with_a_warning() -> None:
    raw = codec_with(sampler_codec(required=False)).encode(base_md(sections={"sampler": STATE}))
    assert b'"required":false' in raw
    with pytest.warns(SectionWarning, match=r"checkpoint ck has optional metadata section\(s\) sampler"):
        md = decode_metadata(raw, "ck")
    assert md == base_md(format_version=2)


def test_issue11_an_unickpt_that_reads_only_version_1_refuses_a_section() -> None:
    """What the version bump buys: an older unickpt (version 1 only) says "upgrade" instead of
    loading the checkpoint without the section's state."""
    old = MetadataCodec(readers={1: v1.READER}, writers={1: v1.WRITER})
    with pytest.raises(UnsupportedFormatVersionError, match=r"format version 2; this unickpt reads versions 1..1"):
        old.decode(V2_BYTES, "ck")
    with pytest.raises(UnsupportedValueError, match="sampler"):
        MetadataCodec(
            readers={1: v1.READER}, writers={1: v1.WRITER}, sections=SectionRegistry([sampler_codec()])
        ).encode(base_md(sections={"sampler": STATE}))


def test_newer_section_schema_version_is_refused_or_skipped() -> None:
    newer = V2_BYTES.replace(b'"version":1', b'"version":2')
    with pytest.raises(UnsupportedFormatVersionError, match=r"'sampler' schema version 2 \(this unickpt reads 1..1\)"):
        codec_with(sampler_codec()).decode(newer, "ck")
    optional = newer.replace(b'"required":true', b'"required":false')
    with pytest.warns(SectionWarning, match=r"sampler \(schema version 2\)"):
        assert codec_with(sampler_codec()).decode(optional).sections == {}


def _v2_doc() -> dict[str, Any]:
    return json.loads(V2_BYTES)


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda d: d.pop("sections"), ["missing field 'sections'"]),
        (lambda d: d.__setitem__("sections", []), ["sections must be an object"]),
        (lambda d: d["sections"]["sampler"].pop("required"), ["section 'sampler'", "exactly the keys"]),
        (lambda d: d["sections"]["sampler"].__setitem__("version", 0), ["version must be an integer >= 1"]),
        (lambda d: d["sections"]["sampler"].__setitem__("required", 1), ["required must be true or false"]),
        (lambda d: d["sections"].__setitem__("Bad Name", {}), ["'Bad Name'", "not a valid section name"]),
        (lambda d: d["sections"]["sampler"]["data"].__setitem__("epoch", -1), ["section 'sampler'", "bad epoch"]),
        (lambda d: d["sections"]["sampler"]["data"].__setitem__("positions", [1] * 5000), ["bad epoch or positions"]),
        (
            lambda d: d["sections"]["sampler"]["data"].__setitem__("positions", [0] * 40000),
            ["section 'sampler'", "exceed its cap of 65536"],
        ),
    ],
)
def test_corrupt_sections_are_corrupt_metadata(mutate, words) -> None:
    d = _v2_doc()
    mutate(d)
    with pytest.raises(CorruptMetadataError) as info:
        codec_with(sampler_codec()).decode(json.dumps(d).encode(), "ck/unickpt.metadata.json")
    msg = str(info.value)
    assert "ck/unickpt.metadata.json" in msg and all(w in msg for w in words), msg


def test_section_and_body_problems_are_reported_together() -> None:
    d = _v2_doc()
    d["sections"]["sampler"]["data"]["epoch"] = "x"
    d["files"] = ["/abs"]
    with pytest.raises(CorruptMetadataError) as info:
        codec_with(sampler_codec()).decode(json.dumps(d).encode())
    assert "2 problems" in str(info.value) and "sampler" in str(info.value) and "'/abs'" in str(info.value)


def test_a_section_codec_bug_is_still_a_checkpoint_error() -> None:
    def broken(data: Any, version: int) -> SamplerState:
        return SamplerState(1 // (data["epoch"] - 3), ())

    with pytest.raises(CorruptMetadataError, match="section 'sampler': ZeroDivisionError"):
        codec_with(sampler_codec(decode=broken)).decode(V2_BYTES)


@pytest.mark.parametrize(
    "codec, record, error, words",
    [
        (sampler_codec(), SamplerState(1, (2,)), None, []),
        (None, STATE, UnsupportedValueError, ["'sampler' is not registered"]),
        (sampler_codec(), {"epoch": 1}, UnsupportedValueError, ["holds a dict, expected SamplerState"]),
        (sampler_codec(max_bytes=10), STATE, SizeLimitError, ["above its cap of 10"]),
        (
            sampler_codec(encode=lambda s: {"epoch": s.epoch, "positions": []}),
            STATE,
            UnsupportedValueError,
            ["does not survive its own encode/decode round trip"],
        ),
        (sampler_codec(encode=lambda s: {"epoch": float("nan")}), STATE, UnsupportedValueError, ["strict JSON"]),
        (sampler_codec(encode=lambda s: {"epoch": -1, "positions": []}), STATE, UnsupportedValueError, ["refuses"]),
    ],
)
def test_writing_a_section_checks_it_reads_back(codec, record, error, words) -> None:
    """A section that would not read back fails the save, not the resume."""
    mc = codec_with(*([codec] if codec else []))
    md = base_md(sections={"sampler": record})
    if error is None:
        assert mc.decode(mc.encode(md)).sections == {"sampler": record}
        return
    with pytest.raises(error) as info:
        mc.encode(md)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_section_registry_rules() -> None:
    reg = SectionRegistry([sampler_codec()])
    with pytest.raises(ValueError, match="already registered"):
        reg.register(sampler_codec())
    assert reg.names() == ("sampler",) and "sampler" in reg and reg.copy().names() == ("sampler",)
    for bad in ("", "Upper", "a b", "x" * 40, "1abc", "a..b"):
        with pytest.raises(ValueError, match="section name"):
            sampler_codec(name=bad)
    with pytest.raises(ValueError, match="min_format_version"):
        sampler_codec(min_format_version=1)
    assert sampler_codec(name="myorg.sampler_state").name == "myorg.sampler_state"


def test_unknown_optional_sections_warn_once_per_decode() -> None:
    d = _v2_doc()
    d["sections"] = {f"s{i}": {"version": 1, "required": False, "data": i} for i in range(50)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decode_metadata(json.dumps(d).encode())
    assert len([w for w in caught if issubclass(w.category, SectionWarning)]) == 1


# --------------------------------------------------------------------------- adding a version (test only)


class V4Reader:
    """A version 4 as a future release might define it: version 2 plus ``"even"`` tensor entries, one
    row per tensor for an even split along dimension 0 (``[parts, file_index, byte_offset,
    [crc per part]]``: part p in file ``file_index`` at ``byte_offset + p * part_bytes``). The
    reader expands them into version-1 shard rows and hands the document to version 2's reader,
    which validates everything as usual."""

    def read(self, doc: dict[str, Any], source: str, sections: SectionRegistry) -> Metadata:
        doc = dict(doc, format_version=2, tensors=dict(doc["tensors"]))
        for fqn, entry in doc["tensors"].items():
            if "even" in entry:
                parts, fidx, boff, crcs = entry["even"]
                shape = entry["shape"]
                rows, cols = shape[0] // parts, shape[1:]
                nbytes = rows * int(np.prod(cols)) * 4
                doc["tensors"][fqn] = {
                    "dtype": entry["dtype"],
                    "shape": shape,
                    "shards": [
                        [p * rows, *[0] * len(cols), rows, *cols, fidx, boff + p * nbytes, nbytes, crcs[p]]
                        for p in range(parts)
                    ],
                }
        return replace(v2.READER.read(doc, source, sections), format_version=4)


class V4Writer:
    def can_write(self, md: Metadata, sections: SectionRegistry) -> bool:
        return True

    def write(self, md: Metadata, sections: SectionRegistry) -> dict[str, Any]:
        doc = v2.WRITER.write(md, sections)
        doc["format_version"] = 4
        assert isinstance(md.checksums, RangeChecksums)
        for fqn, t in md.tensors.items():
            s = t.shards
            if (
                t.dtype == "float32"
                and len(s) > 1
                and all(x.offsets[0] == i * s[0].lengths[0] for i, x in enumerate(s))
            ):
                doc["tensors"][fqn] = {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "even": [
                        len(s),
                        s[0].file_index,
                        s[0].byte_offset,
                        [md.checksums.crc_of(x.file_index, x.byte_offset, x.byte_length) for x in s],
                    ],
                }
        return doc


def test_issue11_a_new_version_is_added_without_touching_the_old_ones() -> None:
    codec = codec_with(sampler_codec()).with_version(4, V4Reader(), V4Writer())
    shards = tuple(ShardRecord((2 * p, 0), (2, 3), 0, 24 * p, 24) for p in range(4))
    tensors = {"w": TensorRecord("w", "float32", (8, 3), shards)}
    md = base_md(lambda p: 100 + p, tensors=tensors, sections={"sampler": STATE})
    assert json.loads(codec.encode(md))["format_version"] == 2  # the lowest version that can say it
    raw = codec.encode(replace(md, format_version=4))
    doc = json.loads(raw)
    assert doc["tensors"]["w"] == {"dtype": "float32", "shape": [8, 3], "even": [4, 0, 0, [100, 101, 102, 103]]}
    assert codec.decode(raw) == replace(md, format_version=4)
    assert codec.decode(V1_BYTES) == decode_metadata(V1_BYTES)  # version 1 read as before
    with pytest.raises(UnsupportedFormatVersionError, match="Upgrade unickpt"):
        decode_metadata(raw)  # today's unickpt
    doc["tensors"]["w"]["even"][0] = 3  # the expanded rows still go through every check
    with pytest.raises(CorruptMetadataError, match=r"tensor 'w': the shards do not cover the shape \(8, 3\)"):
        codec.decode(json.dumps(doc).encode())


def test_v1_reader_ignores_a_sections_key() -> None:
    """Version 1 readers always ignored unknown top-level keys; that stays so."""
    raw = V1_BYTES[:-1] + b',"sections":{"x":1}}'
    assert decode_metadata(raw) == base_md()


def test_table_form_is_version_1_in_both_versions() -> None:
    shards = tuple(ShardRecord((r, 0), (1, 2), 0, 8 * r, 8) for r in range(v1.TABLE_FROM))
    tensors = {"t": TensorRecord("t", "float32", (v1.TABLE_FROM, 2), shards)}
    md = base_md(lambda r: r, tensors=tensors, sections={"sampler": STATE})
    codec = codec_with(sampler_codec())
    doc = json.loads(codec.encode(md))
    table = np.frombuffer(base64.b64decode(doc["tensors"]["t"]["shard_table"]), dtype="<i8").reshape(-1, 8)
    assert table[5].tolist() == [5, 0, 1, 2, 0, 40, 8, 5]
    assert codec.decode(codec.encode(md)).tensors == md.tensors
