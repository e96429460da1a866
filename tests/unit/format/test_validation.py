"""format.validation: the one home of checkpoint validation (decoder, save plan, load targets).

Each check is compared with a plain oracle written here (pairwise overlap, element counting,
row-by-row bounds), property-tested with hypothesis; the collectors are shown to report every
problem of a document or a load in one error.
"""

from __future__ import annotations

import ast
import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.format_sums import chunk_sums
from tests.support.hypothesis_profiles import examples
from unickpt.errors import (
    CorruptMetadataError,
    DtypeMismatchError,
    MissingKeysError,
    ShapeMismatchError,
    UnexpectedKeysError,
)
from unickpt.format import validation
from unickpt.format.codec import decode_metadata, encode_metadata
from unickpt.format.records import BlobRecord, Metadata, ShardRecord, TensorRecord, Topology
from unickpt.format.tiling import check_box_tiling
from unickpt.format.validation import (
    MAX_BYTES,
    box_coverage_problem,
    coverage_problem,
    overlap_problems,
    validate_metadata,
)
from unickpt.planning.load.targets import check_targets
from unickpt.planning.specs import ShardSpec

SETTINGS = settings(max_examples=examples(300), deadline=None, derandomize=True, database=None)
SRC = pathlib.Path(validation.__file__).resolve().parents[1]


def _md(**changes: Any) -> Metadata:
    w = TensorRecord(
        "model.w",
        "float32",
        (4, 3),
        (ShardRecord((0, 0), (2, 3), 0, 0, 24), ShardRecord((2, 0), (2, 3), 1, 0, 24)),
    )
    fields: dict[str, Any] = dict(
        format_version=1,
        save_id="s",
        created_unix=1.0,
        topology=Topology("torch", 2),
        files=("data/s/a.bin", "data/s/b.bin"),
        tensors={"model.w": w},
        blobs={"extra_state/rank0": BlobRecord("extra_state/rank0", 0, 64, 10)},
    )
    fields.update(changes)
    fields.setdefault("checksums", chunk_sums(fields["files"], fields["tensors"], fields["blobs"]))
    return Metadata(**fields)


# --------------------------------------------------------------------------- collect everything, raise once


def test_issue11_decode_reports_every_problem_in_one_error() -> None:
    """Three unrelated problems in one document (a file name escaping the folder, a shard outside
    its tensor, a blob naming a file that does not exist): one CorruptMetadataError names all
    three (the decoder used to stop at the first)."""
    doc = json.loads(encode_metadata(_md()))
    doc["files"][1] = "../escape.bin"
    doc["tensors"]["model.w"]["shards"][1][0] = 3  # rows [3, 5) of a 4-row tensor
    doc["blobs"]["extra_state/rank0"][0] = 7
    with pytest.raises(CorruptMetadataError) as info:
        decode_metadata(json.dumps(doc).encode(), "ck/unickpt.metadata.json")
    msg = str(info.value)
    assert msg.startswith("corrupt checkpoint metadata ck/unickpt.metadata.json: 3 problems:"), msg
    assert "'../escape.bin' escapes" in msg
    assert "tensor 'model.w': shard row 1: box (3, 0)+(2, 3) outside shape (4, 3)" in msg
    assert "blob 'extra_state/rank0' names file #7 of 2" in msg


def test_issue11_problem_list_is_capped_but_counted() -> None:
    doc = json.loads(encode_metadata(_md()))
    for i in range(30):
        doc["tensors"][f"t{i}"] = {"dtype": "float7", "shape": [1], "shards": []}
    with pytest.raises(CorruptMetadataError) as info:
        decode_metadata(json.dumps(doc).encode())
    msg = str(info.value)
    assert "30 problems:" in msg and "... and 10 more" in msg
    assert sum("unknown dtype 'float7'" in line for line in msg.splitlines()) == 20


def test_issue11_validate_metadata_checks_records_built_in_memory() -> None:
    """The decoder's checks on records that never went through JSON (tools, hand-built metadata)."""
    validate_metadata(_md())
    bad = _md(
        files=("data/s/a.bin", "data/s/a.bin"),
        blobs={"k": BlobRecord("k", 0, 8, 100)},  # overlaps model.w's rows [0, 2) in a.bin
    )
    with pytest.raises(CorruptMetadataError) as info:
        validate_metadata(bad, "mem")
    assert "'data/s/a.bin' is listed twice" in str(info.value)
    gap = _md(tensors={"model.w": TensorRecord("model.w", "float32", (4, 3), (ShardRecord((0, 0), (2, 3), 0, 0, 24),))})
    with pytest.raises(
        CorruptMetadataError, match=r"mem: tensor 'model.w': the shards do not cover the shape \(4, 3\)"
    ):
        validate_metadata(gap, "mem")
    overlap = _md(blobs={"k": BlobRecord("k", 0, 8, 100)})
    with pytest.raises(CorruptMetadataError, match="byte ranges of 'model.w' and 'k' overlap in data/s/a.bin"):
        validate_metadata(overlap)


# --------------------------------------------------------------------------- load targets


def _spec(fqn: str, shape: tuple[int, ...], dtype: str = "float32") -> ShardSpec:
    return ShardSpec(fqn, dtype, shape, (0,) * len(shape), shape)


def _targets_md() -> Metadata:
    def rec(fqn: str, shape: tuple[int, ...], dtype: str = "float32") -> TensorRecord:
        return TensorRecord(fqn, dtype, shape, (ShardRecord((0,) * len(shape), shape, 0, 0, 4 * math.prod(shape)),))

    return _md(tensors={r.fqn: r for r in (rec("a", (2,)), rec("b", (3,)), rec("old", (1,)))}, blobs={})


def test_issue11_check_targets_reports_shapes_dtypes_and_keys_at_once() -> None:
    """A load with a shape mismatch, a dtype mismatch and a missing key raises one
    ShapeMismatchError whose message lists all three (it used to name only the shapes)."""
    specs = [_spec("a", (5,)), _spec("b", (3,), "float64"), _spec("new", (1,))]
    with pytest.raises(ShapeMismatchError) as info:
        check_targets(_targets_md(), specs, strict=True, source="ck")
    msg = str(info.value)
    assert "a: checkpoint shape (2,), live shape (5,)" in msg
    assert "b: checkpoint dtype float32, live dtype float64" in msg
    assert "key(s) of the live state are not in checkpoint ck: new" in msg and "old" in msg


def test_check_targets_error_class_follows_the_worst_problem() -> None:
    md = _targets_md()
    with pytest.raises(DtypeMismatchError, match="new"):
        check_targets(md, [_spec("b", (3,), "int64"), _spec("new", (1,))], strict=True, source="ck")
    with pytest.raises(MissingKeysError):
        check_targets(md, [_spec("a", (2,)), _spec("new", (1,))], strict=True, source="ck")
    report = check_targets(md, [_spec("a", (2,)), _spec("new", (1,))], strict=False, source="ck")
    assert (report.missing, report.unexpected) == (("new",), ("b", "old"))


@pytest.mark.parametrize(
    "strict, raises, missing, unexpected",
    [
        (True, MissingKeysError, (), ()),
        (False, None, ("new",), ("b", "old")),
    ],
)
def test_issue11_strictness_enum(strict, raises, missing, unexpected) -> None:
    md = _targets_md()
    specs = [_spec("a", (2,)), _spec("new", (1,))]
    if raises is None:
        report = check_targets(md, specs, strict=strict, source="ck")
        assert (report.missing, report.unexpected) == (missing, unexpected)
    else:
        with pytest.raises(raises):
            check_targets(md, specs, strict=strict, source="ck")


def test_issue41_item3_strictness_is_the_bool_load_takes() -> None:
    """The four-mode enum is gone (its partial modes had no caller): a strict load refuses
    unexpected keys alone with UnexpectedKeysError, a non-strict one returns both kinds."""
    from unickpt.planning.load import targets

    assert not hasattr(targets, "Strictness")
    md = _targets_md()
    with pytest.raises(UnexpectedKeysError, match="b, old"):
        check_targets(md, [_spec("a", (2,))], strict=True, source="ck")
    assert check_targets(md, [_spec("a", (2,))], strict=False, source="ck") == targets.KeyReport((), ("b", "old"))
    everything = [_spec("a", (2,)), _spec("b", (3,)), _spec("old", (1,))]
    assert check_targets(md, everything, strict=True, source="ck") == targets.KeyReport((), ())


def test_planning_uses_format_validation() -> None:
    """One implementation: the load checks live in planning.load.targets (format.validation
    keeps none), planning calls the coverage and byte checks of format.validation; format never
    imports planning."""
    from unickpt.planning import load
    from unickpt.planning.load import targets
    from unickpt.planning.save import layout as save_layout
    from unickpt.planning.save import rows

    assert load.check_targets is targets.check_targets and load.keys_error is targets.keys_error
    assert not hasattr(validation, "check_targets") and not hasattr(validation, "keys_error")
    assert rows.box_coverage_problem is validation.box_coverage_problem
    assert save_layout.overlap_problems is validation.overlap_problems
    for path in (SRC / "format").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "planning" not in (node.module or ""), (path.name, node.module)


# --------------------------------------------------------------------------- byte ranges


ranges_strategy = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 12), st.integers(0, 5)), min_size=0, max_size=12)


def _pairwise_overlap(ranges: list[tuple[int, int, int]]) -> bool:
    """Oracle: two ranges of one file share a byte, or an empty range lies strictly inside another."""
    for i, (fa, oa, la) in enumerate(ranges):
        for fb, ob, lb in ranges[i + 1 :]:
            if fa != fb:
                continue
            if max(oa, ob) < min(oa + la, ob + lb):
                return True
            if (la == 0 and ob < oa < ob + lb) or (lb == 0 and oa < ob < oa + la):
                return True
    return False


@SETTINGS
@given(ranges_strategy)
def test_overlap_check_agrees_with_pairwise_comparison(ranges) -> None:
    files = ["f0", "f1", "f2"]
    arrays = [np.array(c, dtype=np.int64) for c in zip(*ranges)] if ranges else [np.zeros(0, np.int64)] * 3
    who = np.arange(len(ranges), dtype=np.int64)
    found = overlap_problems(files, [f"r{i}" for i in range(len(ranges))], who, *arrays)
    assert bool(found) == _pairwise_overlap(ranges), (ranges, found)


def test_planner_self_checks_its_byte_layout() -> None:
    """plan_save refuses a layout whose entries overlap in a file (the decoder would refuse it):
    an invariant of the planner itself, so an ``InternalError``."""
    from unickpt.errors import InternalError
    from unickpt.planning.save.layout import check_layout

    def rows(*offsets: int) -> list[tuple[np.ndarray, ...]]:
        who, fidx, lens = np.arange(2), np.zeros(2, dtype=np.int64), np.full(2, 16, dtype=np.int64)
        return [(who, fidx, np.array(offsets, dtype=np.int64), lens)]

    check_layout(["f"], rows(0, 64), ["a", "b"])
    with pytest.raises(InternalError, match="byte ranges of 'a' and 'b' overlap in f"):
        check_layout(["f"], rows(0, 8), ["a", "b"])


# --------------------------------------------------------------------------- shard rows and coverage


@st.composite
def tables(draw: Callable[..., Any]) -> tuple[tuple[int, ...], int, np.ndarray, int]:
    """A shape, an item size, shard rows near every bound (negative, absurd, outside, wrong byte
    length, file index, checksum) and a file count."""
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    isz = draw(st.sampled_from([1, 2, 4, 8]))
    nfiles = draw(st.integers(1, 3))
    value = st.integers(-1, 6) | st.sampled_from([MAX_BYTES, MAX_BYTES + 1, 1 << 32, (1 << 32) - 1])
    rows = []
    for _ in range(draw(st.integers(0, 5))):
        offs = [draw(st.integers(0, s)) for s in shape]
        lens = [draw(st.integers(0, s - o)) for s, o in zip(shape, offs)]
        row = [*offs, *lens, draw(st.integers(0, nfiles - 1)), draw(st.integers(0, 99)), 0]
        row[-1] = math.prod(lens) * isz
        for _ in range(draw(st.integers(0, 2))):  # break a field or two
            row[draw(st.integers(0, len(row) - 1))] = draw(value)
        rows.append(row)
    return shape, isz, np.array(rows, dtype=np.int64).reshape(len(rows), 2 * len(shape) + 3), nfiles


def _row_oracle(shape: tuple[int, ...], isz: int, table: np.ndarray, nfiles: int) -> bool:
    """Oracle: every row in bounds, row by row, as the format's rules state them."""
    nd = len(shape)
    for row in table.tolist():
        offs, lens, (fidx, boff, blen) = row[:nd], row[nd : 2 * nd], row[2 * nd :]
        if any(v < 0 or v > MAX_BYTES for v in row) or any(o + n > s for o, n, s in zip(offs, lens, shape)):
            return False
        if fidx >= nfiles or boff + blen > MAX_BYTES or blen != math.prod(lens) * isz:
            return False
    return True


@SETTINGS
@given(tables())
def test_row_bounds_fast_path_and_vectorised_checks_agree_with_the_rules(case) -> None:
    shape, isz, table, nfiles = case
    want = _row_oracle(shape, isz, table, nfiles)
    assert validation._rows_ok(shape, isz, table.tolist(), nfiles) == want
    big = np.repeat(table, 1 + validation._SMALL // max(table.size, 1), axis=0)  # the vectorised path
    assert (validation._row_problems("t", shape, isz, big, nfiles) == []) == want


@st.composite
def one_dim_layouts(draw: Callable[..., Any]) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Boxes that split a shape along one dimension (a row or column sharding), with empty boxes,
    then maybe broken (a box dropped, duplicated, shifted or grown)."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
    if not shape:
        return shape, [((), ())] * draw(st.integers(0, 2))
    d = draw(st.integers(0, len(shape) - 1))
    cuts = sorted(set(draw(st.lists(st.integers(0, shape[d]), max_size=4))) | {0, shape[d]})
    boxes = []
    for a, b in zip(cuts, cuts[1:]):
        offs = tuple(a if k == d else 0 for k in range(len(shape)))
        lens = tuple(b - a if k == d else s for k, s in enumerate(shape))
        boxes.append((offs, lens))
    if draw(st.booleans()):
        boxes.append((tuple(0 for _ in shape), tuple(0 if k == d else s for k, s in enumerate(shape))))
    action = draw(st.sampled_from(["keep", "drop", "dup", "shift", "grow"]))
    i = draw(st.integers(0, len(boxes) - 1))
    offs, lens = boxes[i]
    if action == "drop":
        boxes.pop(i)
    elif action == "dup":
        boxes.append(boxes[i])
    elif action == "shift":
        boxes[i] = (tuple(o + (k == d) for k, o in enumerate(offs)), lens)
    elif action == "grow":
        boxes[i] = (offs, tuple(n + (k == d) for k, n in enumerate(lens)))
    return shape, boxes


@SETTINGS
@given(one_dim_layouts())
def test_coverage_fast_path_agrees_with_the_tiling_algorithm(case) -> None:
    """The quick accept for one-dimension splits never says "tiles" when format.tiling says
    otherwise, and both entry points give format.tiling's verdict and sentence."""
    shape, boxes = case
    truth = check_box_tiling(shape, boxes)
    fast = validation.splits_one_dim(shape, [list(o) for o, _ in boxes], [list(n) for _, n in boxes])
    assert not (fast and truth is not None), (shape, boxes)
    assert box_coverage_problem(shape, boxes) == (None if truth is None else str(truth))
    in_bounds = all(o >= 0 and n >= 0 and o + n <= s for offs, lens in boxes for o, n, s in zip(offs, lens, shape))
    if in_bounds:
        offsets = np.array([o for o, _ in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
        lengths = np.array([n for _, n in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
        assert coverage_problem(shape, offsets, lengths) == (None if truth is None else str(truth))


def test_one_whole_box_is_accepted_quickly_and_only_when_it_tiles() -> None:
    assert validation.splits_one_dim((3, 4), [[0, 0]], [[3, 4]])
    assert validation.splits_one_dim((), [[]], [[]])  # a 0-d tensor's one box
    assert not validation.splits_one_dim((3, 0), [[0, 0]], [[3, 0]])  # no element: not this layout
    assert not validation.splits_one_dim((-1,), [[0]], [[-1]])
    assert not validation.splits_one_dim((3, 4), [[1, 0]], [[3, 4]])


def test_problems_collector_text() -> None:
    p = validation.Problems(keep=2)
    assert not p
    p.add("one")
    assert p.text() == "one"
    p.extend(["two", "three"])
    assert p.text() == "3 problems:\n  one\n  two\n  ... and 1 more"
    with pytest.raises(ValueError, match="3 problems"):
        p.raise_if_any(ValueError)
