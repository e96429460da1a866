"""Fuzzing the metadata path: random and mutated metadata never raise anything but a
CheckpointError, through decode, validation, planning and a whole load.

``UNICKPT_FUZZ_EXAMPLES`` (default 150) sets the examples per test; the runs are derandomized so
CI is reproducible (``UNICKPT_FUZZ_RANDOM=1`` explores fresh random inputs). Crashes found are kept
below as explicit regression examples.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import random
import re
import warnings
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import unickpt
from tests.workers.rel_helpers import tiny_model
from unickpt.errors import CheckpointError, CorruptMetadataError
from unickpt.folder.publish import publish
from unickpt.format import MetadataCodec, SectionCodec, SectionRegistry, SectionWarning
from unickpt.format.codec import DEFAULT_CODEC, decode_metadata
from unickpt.format.records import METADATA_FILE
from unickpt.format.tiling import check_box_tiling
from unickpt.frameworks import get_framework
from unickpt.planning.boxes import decompose_flat_range
from unickpt.planning.load.overlap import plan_local_load
from unickpt.planning.load.targets import check_targets
from unickpt.storage.memory import MemoryStorage

N = int(os.environ.get("UNICKPT_FUZZ_EXAMPLES", "150"))
RANDOM = os.environ.get("UNICKPT_FUZZ_RANDOM") == "1"  # explore new inputs instead of the fixed ones
FUZZ = settings(
    max_examples=N,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_MEM_ROOT = "unickpt-fuzz"


def _fresh_state() -> dict[str, Any]:
    model, optim = tiny_model(seed=11)
    return {"model": model, "optimizer": optim, "extra_state": None}


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A real checkpoint: its metadata bytes and doc; its data files copied to memory://."""
    model, optim = tiny_model()
    ckpt = str(tmp_path_factory.mktemp("fuzz") / "ck")
    unickpt.save(
        ckpt, {"model": model, "optimizer": optim, "extra_state": {"step": 7, "t": (1, 2.5, None)}}, framework="torch"
    )
    raw = open(os.path.join(ckpt, METADATA_FILE), "rb").read()
    doc = json.loads(raw)
    mem = MemoryStorage(_MEM_ROOT)
    for name in doc["files"]:
        mem.write(name, [open(os.path.join(ckpt, name), "rb").read()])
    state = _fresh_state()
    view = get_framework("torch", state).load_view(state, decode_metadata(raw))
    specs = [i.spec for i in view.items]
    return raw, doc, specs


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


_INTS = st.sampled_from([-1, 0, 1, 3, 7, 255, 2**31, 2**32, 2**53 + 1, 2**60, 2**63, 2**64, 10**15, -(2**63)])
_LEAF = (
    st.none()
    | st.booleans()
    | _INTS
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
_JSON = st.recursive(
    _LEAF, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12
)
_MUTATION = st.tuples(st.sampled_from(["replace", "delete", "grow", "shrink"]), st.integers(0, 10**6), _JSON)


def _mutate(doc: dict, mutations: list[tuple[str, int, Any]], skip: tuple[str, ...] = ()) -> dict:
    """Apply ``mutations`` (operation, which path, new value) to a copy of ``doc``; paths under
    a top-level key in ``skip`` are left alone."""
    doc = copy.deepcopy(doc)
    for op, pick, value in mutations:
        paths = [p for p in _paths(doc) if p and p[0] not in skip]
        if not paths:
            break
        path = paths[pick % len(paths)]
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        target = parent[key]
        if op == "replace":
            parent[key] = value
        elif op == "delete":
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif op == "grow" and isinstance(target, list):
            target.append(value if not target else copy.deepcopy(target[pick % len(target)]))
        elif op == "shrink" and isinstance(target, (list, dict)) and target:
            if isinstance(target, list):
                target.pop(pick % len(target))
            else:
                del target[sorted(target)[pick % len(target)]]
    return doc


def _encode(doc: dict) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


def _decode_check_plan(data: bytes, specs: list) -> None:
    md = decode_metadata(data, "fuzz/unickpt.metadata.json")
    for strict in (True, False):
        try:
            check_targets(md, specs, strict=strict, source="fuzz")
        except CheckpointError:
            continue
        plan_local_load(md, specs)


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_decode(data):
    try:
        decode_metadata(data, "fuzz")
    except CheckpointError:
        pass


@FUZZ
@given(cut=st.integers(0, 10**9), flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 255)), max_size=4))
def test_truncated_and_bit_flipped_metadata(valid, cut, flips):
    raw, _doc, specs = valid
    data = bytearray(raw[: cut % (len(raw) + 1)])
    for at, mask in flips:
        if data:
            data[at % len(data)] ^= mask
    try:
        _decode_check_plan(bytes(data), specs)
    except CheckpointError:
        pass


@FUZZ
@given(st.lists(_MUTATION, min_size=1, max_size=3))
@example([("replace", 0, "x" * 5000)])
@example([("replace", 3, 10**5000)])  # regression: an int too long to parse escaped as ValueError
def test_mutated_metadata_decode_check_plan(valid, mutations):
    raw, doc, specs = valid
    if any(isinstance(v, int) and v == 10**5000 for _o, _p, v in mutations):
        data = raw.replace(b'"format_version":1', b'"format_version":' + b"1" * 5000)
    else:
        data = _encode(_mutate(doc, mutations))
    try:
        _decode_check_plan(data, specs)
    except CheckpointError:
        pass


@FUZZ
@given(st.lists(_MUTATION, min_size=1, max_size=3))
def test_mutated_metadata_whole_load(valid, mutations):
    """The whole ``unickpt.load`` over the real data files (in memory://) and a mutated metadata."""
    _raw, doc, _specs = valid
    mem = MemoryStorage(_MEM_ROOT)
    publish(mem, METADATA_FILE, _encode(_mutate(doc, mutations, skip=())))
    try:
        unickpt.load(f"memory://{_MEM_ROOT}", _fresh_state(), framework="torch")
    except CheckpointError:
        pass


# --------------------------------------------------------------------------- version 2: sections


@dataclass(frozen=True, slots=True)
class _Note:
    """A test-only metadata section: a label and a few counts."""

    label: str
    counts: tuple[int, ...]


def _note_decode(data: Any, version: int) -> _Note:
    if not isinstance(data, dict) or not isinstance(data.get("label"), str) or len(data["label"]) > 64:
        raise CorruptMetadataError("note: bad label")
    counts = data.get("counts")
    if not isinstance(counts, list) or len(counts) > 16 or not all(type(c) is int and 0 <= c < 1 << 32 for c in counts):
        raise CorruptMetadataError("note: bad counts")
    return _Note(data["label"], tuple(counts))


_NOTE_CODEC = MetadataCodec(
    sections=SectionRegistry(
        [
            SectionCodec(
                name="fuzz.note",
                record_type=_Note,
                encode=lambda n: {"label": n.label, "counts": list(n.counts)},
                decode=_note_decode,
                max_bytes=1024,
            )
        ]
    )
)


@pytest.fixture(scope="module")
def valid_v2(valid):
    """The real checkpoint's metadata with a section: a document with sections (version 3, as
    saves write it; version 2 carries sections the same way)."""
    raw, _doc, specs = valid
    md = replace(decode_metadata(raw), sections={"fuzz.note": _Note("resume", (3, 1, 4))})
    raw2 = _NOTE_CODEC.encode(md)
    assert json.loads(raw2)["format_version"] == 3
    return raw2, json.loads(raw2), specs


def _decode_v2_check_plan(data: bytes, specs: list) -> None:
    """Both the codec that knows the section and today's default one (which does not)."""
    for codec in (_NOTE_CODEC, DEFAULT_CODEC):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SectionWarning)
                md = codec.decode(data, "fuzz/unickpt.metadata.json")
        except CheckpointError:
            continue
        assert all(isinstance(v, _Note) for v in md.sections.values())
        for strict in (True, False):
            try:
                check_targets(md, specs, strict=strict, source="fuzz")
            except CheckpointError:
                continue
            plan_local_load(md, specs)


@FUZZ
@given(st.lists(_MUTATION, min_size=1, max_size=3))
@example([("replace", 1, 2)])
def test_issue11_mutated_v2_documents_with_sections(valid_v2, mutations):
    """Version-2 documents with a section, mutated (sections included): decode, validation and
    planning raise nothing but CheckpointErrors, with and without the section registered."""
    _raw, doc, specs = valid_v2
    _decode_v2_check_plan(_encode(_mutate(doc, mutations)), specs)


@FUZZ
@given(st.lists(_MUTATION, min_size=1, max_size=3))
@example([("replace", 6, 2**40)])  # a count beyond the section's own bound
@example([("replace", 2, False)])  # required -> false
@example([("delete", 1, None)])
def test_issue11_mutated_section_envelopes(valid_v2, mutations):
    """Mutations aimed at the sections object only (envelopes, names, section data)."""
    _raw, doc, specs = valid_v2
    d = copy.deepcopy(doc)
    mutated = _mutate({"sections": d.pop("sections")}, mutations)
    if "sections" in mutated:  # else: a version-2 document without sections
        d["sections"] = mutated["sections"]
    _decode_v2_check_plan(_encode(d), specs)


@FUZZ
@given(cut=st.integers(0, 10**9), flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 255)), max_size=4))
def test_issue11_truncated_and_bit_flipped_v2_metadata(valid_v2, cut, flips):
    raw, _doc, specs = valid_v2
    data = bytearray(raw[: cut % (len(raw) + 1)])
    for at, mask in flips:
        if data:
            data[at % len(data)] ^= mask
    _decode_v2_check_plan(bytes(data), specs)


def test_issue11_whole_load_of_a_v2_checkpoint_with_an_optional_unknown_section(valid_v2):
    """unickpt.load of version-2 metadata whose only section is optional and unknown here: it
    loads bit-exact, with a SectionWarning; the same section marked required is refused."""
    _raw, doc, _specs = valid_v2
    mem = MemoryStorage(_MEM_ROOT)
    d = copy.deepcopy(doc)
    d["sections"]["fuzz.note"]["required"] = False
    publish(mem, METADATA_FILE, _encode(d))
    state = _fresh_state()
    with pytest.warns(SectionWarning, match="fuzz.note"):
        unickpt.load(f"memory://{_MEM_ROOT}", state, framework="torch")
    want, _ = tiny_model()
    for k, v in want.state_dict().items():
        assert torch.equal(state["model"].state_dict()[k], v), k
    d["sections"]["fuzz.note"]["required"] = True
    publish(mem, METADATA_FILE, _encode(d))
    with pytest.raises(unickpt.UnsupportedFormatVersionError, match="fuzz.note"):
        unickpt.load(f"memory://{_MEM_ROOT}", _fresh_state(), framework="torch")


@pytest.mark.parametrize(
    "bad",
    [{}, {"param_groups": None}, {"param_groups": [{"lr": 1.0}]}, []],
    ids=["no groups", "groups None", "group without params", "a list"],
)
def test_malformed_optimizer_object_is_a_checkpoint_error(valid, bad):
    _raw, doc, _specs = valid
    doc = copy.deepcopy(doc)
    doc["objects"]["optimizer"] = bad
    publish(MemoryStorage(_MEM_ROOT), METADATA_FILE, _encode(doc))
    with pytest.raises(CheckpointError):
        unickpt.load(f"memory://{_MEM_ROOT}", _fresh_state(), framework="torch")


def _random_boxes(rng: random.Random) -> tuple[tuple[int, ...], list]:
    """A random tiling of a random shape (by recursive splits), then maybe broken."""
    shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 3)))
    boxes: list = []

    def split(offs: tuple, lens: tuple, depth: int) -> None:
        if not lens or depth > 3 or rng.random() < 0.3:
            boxes.append((offs, lens))
            return
        d = rng.randrange(len(lens))
        if lens[d] < 2:
            boxes.append((offs, lens))
            return
        c = rng.randint(1, lens[d] - 1)
        split(offs, lens[:d] + (c,) + lens[d + 1 :], depth + 1)
        split(offs[:d] + (offs[d] + c,) + offs[d + 1 :], lens[:d] + (lens[d] - c,) + lens[d + 1 :], depth + 1)

    split((0,) * len(shape), shape, 0)
    r = rng.random()
    if r < 0.3 and boxes:
        boxes.pop(rng.randrange(len(boxes)))  # a gap
    elif r < 0.55 and boxes:
        boxes.append(rng.choice(boxes))  # a duplicate
    elif r < 0.8:  # a random extra box
        offs = tuple(rng.randint(0, s) for s in shape)
        boxes.append((offs, tuple(rng.randint(0, s - o) for s, o in zip(shape, offs))))
    return shape, boxes


@FUZZ
@given(st.integers(0, 2**32))
def test_tiling_check_agrees_with_an_element_count(seed):
    """format.tiling.check_box_tiling (the one check run on every decode and every save plan)
    says "tiles" exactly when counting elements does."""
    shape, boxes = _random_boxes(random.Random(seed))
    counts = {}
    for offs, lens in boxes:
        for element in itertools.product(*(range(o, o + n) for o, n in zip(offs, lens))):
            counts[element] = counts.get(element, 0) + 1
    tiles = len(counts) == math.prod(shape) and set(counts.values()) <= {1}
    tiles = tiles and all(all(e < s for e, s in zip(el, shape)) for el in counts)
    assert (check_box_tiling(shape, boxes) is None) == tiles, (shape, boxes)


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda rows: rows.pop(), ["do not cover the shape (4, 6)", "[4, 6) of dimension 1 are not saved"]),
        (
            lambda rows: rows.append(rows[0][:5] + [6 * 16] + rows[0][6:]),
            ["shards (0, 0)+(2, 2) and (0, 0)+(2, 2) overlap", "[0, 2) of dimension 1 are saved twice"],
        ),
    ],
    ids=["shard missing", "shard duplicated"],
)
def test_shards_that_do_not_tile_are_corrupt_metadata(change, words):
    """A 4x6 tensor saved as a 2x3 grid of 2x2 shards, then one shard dropped or duplicated (the
    copy with its own bytes): a load would keep stale values or copy elements twice."""
    rows = [[r, c, 2, 2, 0, (r * 3 + c) * 16, 16, 0] for r in (0, 2) for c in (0, 2, 4)]
    change(rows)
    doc = {
        "magic": "unickpt",
        "format_version": 1,
        "save_id": "s",
        "created_unix": 0,
        "role": None,
        "topology": {"framework": "torch", "world_size": 1, "mesh": []},
        "files": ["data/s/r0.bin"],
        "tensors": {"w": {"dtype": "float32", "shape": [4, 6], "shards": rows}},
        "objects": {},
        "blobs": {},
    }
    with pytest.raises(unickpt.CorruptMetadataError, match="tensor 'w': ") as ei:
        decode_metadata(json.dumps(doc).encode(), "ck/unickpt.metadata.json")
    msg = str(ei.value)
    assert all(w in msg for w in words) and "ck/unickpt.metadata.json" in msg, msg


@FUZZ
@given(st.lists(st.integers(1, 7), min_size=0, max_size=4), st.integers(1, 6), st.integers(0, 2**32))
def test_codec_accepts_flat_shard_decompositions(shape, ranks, seed):
    """FSDP1 / ZeRO flat shards are saved as decomposed boxes (planning.boxes.decompose_flat_range):
    the decode-time tiling check must accept every such split of a tensor across ranks."""
    shape_t = tuple(shape)
    total = math.prod(shape_t)
    rng = random.Random(seed)
    cuts = sorted({0, total} | {rng.randint(0, total) for _ in range(ranks - 1)})
    boxes = [(p.offsets, p.lengths) for a, b in zip(cuts, cuts[1:]) for p in decompose_flat_range(shape_t, a, b - a)]
    assert check_box_tiling(shape_t, boxes) is None, (shape_t, cuts, boxes)
    if len(boxes) > 1:  # and notices one piece missing
        assert check_box_tiling(shape_t, boxes[:-1]) is not None


# --------------------------------------------------------------------------- value blobs (extra state)


def _rich_value() -> Any:
    """One value using every tag of the value encoding (format.values)."""
    import collections

    import numpy as np
    import torch

    rec = np.zeros(2, dtype=np.dtype([("a", "<i4"), ("b", [("c", ">f2", (2,))]), ("t", "<M8[s]")], align=True))
    return {
        "tuple": (1, "a", None),
        "ints": {3: [2**70, -(2**65)]},
        "od": collections.OrderedDict([("x", 1.5), (2, float("nan"))]),
        "sets": [{1, 2}, frozenset({"a"})],
        "complex": complex(1, float("inf")),
        "bytes": [b"\x00", bytearray(b"ab")],
        "torch": [torch.Size([2, 3]), torch.float16, torch.device("cuda", 1)],
        "tensor": torch.arange(6.0).reshape(2, 3).requires_grad_(),
        "param": torch.nn.Parameter(torch.ones(2)),
        "arrays": [np.arange(3, dtype=">i4"), rec, np.array(1.5)],
        "scalars": [np.float32(2.5), np.datetime64("2024-01-01"), rec[0]],
        "dtype": rec.dtype,
    }


_TAGS = st.sampled_from(
    [
        "tuple", "intdict", "odict", "set", "frozenset", "bigint", "float", "complex", "bytes", "bytearray",
        "size", "torch_dtype", "device", "tensor", "ndarray", "npscalar", "np_dtype", "nope",
    ]
)  # fmt: skip
_FIELD_VALUES = (
    _JSON
    | st.sampled_from(["AAAA", "", "AAAAAAAAAAA=", "!!", "<f4", "|O", "float32", "cuda:0", "9" * 5000, "nan"])
    | st.lists(st.integers(-(2**70), 2**70), max_size=5)
    | st.fixed_dictionaries({"fields": st.lists(st.lists(_JSON, max_size=3), max_size=2), "itemsize": _INTS})
    | st.fixed_dictionaries({"sub": st.sampled_from(["<i4", "|O", {}]), "shape": st.lists(_INTS, max_size=3)})
)
_TAGGED = st.recursive(
    _LEAF,
    lambda c: (
        st.lists(c, max_size=3)
        | st.fixed_dictionaries(
            {"__unickpt__": _TAGS},
            optional={
                "v": _FIELD_VALUES | st.lists(c, max_size=3) | st.lists(st.tuples(_LEAF, c).map(list), max_size=3),
                "dtype": _FIELD_VALUES,
                "shape": _FIELD_VALUES,
                "requires_grad": _LEAF,
                "parameter": _LEAF,
            },
        )
    ),
    max_leaves=8,
)


def _only_checkpoint_errors(data: bytes) -> None:
    from unickpt.format.values import loads_value

    try:
        loads_value(data, "fuzz blob")
    except CheckpointError:
        pass


@FUZZ
@given(_TAGGED)
@example({"__unickpt__": "tensor", "dtype": "float32", "shape": [-1, -1], "v": "AAAAAA=="})  # was RuntimeError
@example({"__unickpt__": "tensor", "dtype": "float32", "shape": [0, -5], "v": ""})
def test_item12_random_tagged_values_raise_only_checkpoint_errors(doc):
    """Issue 9 item 12: value blobs (extra state, dataloader state, optimizer objects) made of
    random tags with random fields decode or raise a CheckpointError, nothing else."""
    _only_checkpoint_errors(_encode({"x": doc}))


@FUZZ
@given(st.lists(_MUTATION, min_size=1, max_size=3))
@example([("replace", 1, -1)])
@example([("replace", 40, [-1, -1])])
def test_item12_mutated_value_blobs_raise_only_checkpoint_errors(mutations):
    """A real encoding of every supported type, mutated (fields replaced, deleted, lists grown or
    shrunk): decodes or raises a CheckpointError."""
    from unickpt.format.values import dumps_value

    doc = json.loads(dumps_value(_rich_value()))
    _only_checkpoint_errors(_encode(_mutate(doc, mutations)))


@FUZZ
@given(st.binary(max_size=512))
def test_item12_random_bytes_as_value_blob(data):
    _only_checkpoint_errors(data)


_ABSURD = st.sampled_from(
    [
        b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1e300", b"-5", b"-0.5", b"true", b"null",
        b'"12"', b"[]", b"{}", b"1" * 400, b"2" * 30, b"253402300800", b"4294967296", b"9007199254740993",
    ]
)  # fmt: skip
_NUMERIC_FIELDS = [
    b'"created_unix":1700000000.5',
    b'"world_size":1',
    b'"format_version":1',
    b'"shape":[4,6]',
    b'"shape":[4,6],"shards":[[0,0,4,6',
]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_NUMERIC_FIELDS), _ABSURD), min_size=1, max_size=3))
@example([(b'"created_unix":1700000000.5', b"NaN")])
def test_item12_absurd_numbers_in_metadata_are_refused(replacements):
    """Issue 9 item 12: NaN, infinities, huge or negative numbers in the metadata's numeric fields
    decode to a CorruptMetadataError (or a value every tool can print), never anything else."""
    from unickpt.ops.inspect import format_text, summarize, to_json

    doc = {
        "magic": "unickpt",
        "format_version": 1,
        "save_id": "s",
        "created_unix": 1700000000.5,
        "role": None,
        "topology": {"framework": "torch", "world_size": 1, "mesh": []},
        "files": ["data/s/r0.bin"],
        "tensors": {"w": {"dtype": "float32", "shape": [4, 6], "shards": [[0, 0, 4, 6, 0, 0, 96, 0]]}},
        "objects": {},
        "blobs": {},
    }
    data = json.dumps(doc, separators=(",", ":")).encode()
    for field, value in replacements:
        head, _, tail = field.rpartition(b":")
        data = data.replace(field, head + b":" + value + (b"," + tail.split(b",", 1)[1] if b"," in tail else b""), 1)
    try:
        md = decode_metadata(data, "fuzz")
    except CheckpointError:
        return
    assert math.isfinite(md.created_unix)
    summary = summarize(md, "fuzz")
    format_text(summary)
    to_json(summary)


def test_item12_inspect_of_non_finite_created_unix_is_a_clean_error(tmp_path, capsys):
    """``unickpt inspect`` on metadata whose created_unix is NaN used to end in a traceback
    (ValueError from time.gmtime); now it exits non-zero with a CorruptMetadataError."""
    from unickpt import cli

    model, optim = tiny_model()
    ckpt = tmp_path / "ck"
    unickpt.save(str(ckpt), {"model": model, "optimizer": optim}, framework="torch")
    meta = ckpt / METADATA_FILE
    good = meta.read_bytes()
    created = re.search(rb'"created_unix":\s*[0-9.e+]+', good).group(0)
    for bad, word in (
        (b"NaN", b"NaN"),
        (b"Infinity", b"Infinity"),
        (b"1e400", b"created_unix"),
        (b"-1e12", b"created_unix"),
    ):
        meta.write_bytes(good.replace(created, b'"created_unix":' + bad))
        code = cli.main(["inspect", str(ckpt)])
        err = capsys.readouterr().err
        assert code != 0 and "CorruptMetadataError" in err and word.decode() in err, (bad, err)
