"""``LoadOptions`` grouped (issue 29, item 6): ``io=ReadOptions``, ``limits=LoadLimits``,
``restore=RestoreOptions``; the flat keywords and attributes of earlier releases still work, with
a DeprecationWarning naming the grouped spelling; refused values give the errors they gave.

The expected groups are written out here (``FLAT``), not taken from ``unickpt.options``.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unickpt import LoadOptions, transforms
from unickpt.options import ExtraStateOnResize, LoaderOnResize, LoadLimits, ReadOptions, RestoreOptions
from unickpt.storage import StorageOptions


def _rename(key: str) -> str | None:
    return key.replace("transformer.", "")


QKV = (
    transforms.split_rows("model.qkv.weight", [("model.q.weight", 2), ("model.k.weight", 1), ("model.v.weight", 1)]),
)

# flat keyword -> (a value, the grouped spelling that value must give)
FLAT: dict[str, tuple[Any, LoadOptions]] = {
    "io_threads": (8, LoadOptions(io=ReadOptions(threads=8))),
    "dedup_reads": (True, LoadOptions(io=ReadOptions(dedup_reads=True))),
    "max_metadata_bytes": (1 << 20, LoadOptions(limits=LoadLimits(max_metadata_bytes=1 << 20))),
    "max_blob_bytes": (4096, LoadOptions(limits=LoadLimits(max_blob_bytes=4096))),
    "key_map": (_rename, LoadOptions(restore=RestoreOptions(key_map=_rename))),
    "transforms": (QKV, LoadOptions(restore=RestoreOptions(transforms=QKV))),
    "cast_dtypes": (True, LoadOptions(restore=RestoreOptions(cast_dtypes=True))),
    "extra_state_on_resize": ("rank0", LoadOptions(restore=RestoreOptions(extra_state_on_resize="rank0"))),
    "loader_on_resize": ("skip", LoadOptions(restore=RestoreOptions(loader_on_resize="skip"))),
}
NEW_SPELLING = {  # what the warning tells to write instead
    "io_threads": "LoadOptions(io=ReadOptions(threads=...))",
    "dedup_reads": "LoadOptions(io=ReadOptions(dedup_reads=...))",
    "max_metadata_bytes": "LoadOptions(limits=LoadLimits(max_metadata_bytes=...))",
    "max_blob_bytes": "LoadOptions(limits=LoadLimits(max_blob_bytes=...))",
    "key_map": "LoadOptions(restore=RestoreOptions(key_map=...))",
    "transforms": "LoadOptions(restore=RestoreOptions(transforms=...))",
    "cast_dtypes": "LoadOptions(restore=RestoreOptions(cast_dtypes=...))",
    "extra_state_on_resize": "LoadOptions(restore=RestoreOptions(extra_state_on_resize=...))",
    "loader_on_resize": "LoadOptions(restore=RestoreOptions(loader_on_resize=...))",
}
UNMOVED = {"verify_checksums": False, "stage_before_apply": True, "timeout": 30.0, "pause_gc": False}


def test_the_defaults_are_those_of_the_flat_options() -> None:
    opts = LoadOptions()
    assert (opts.io.threads, opts.io.dedup_reads) == (4, None)
    assert (opts.limits.max_metadata_bytes, opts.limits.max_blob_bytes) == (1 << 30, 1 << 30)
    r = opts.restore
    assert (r.key_map, tuple(r.transforms), r.cast_dtypes) == (None, (), False)
    assert r.extra_state_on_resize is ExtraStateOnResize.MODULO and r.loader_on_resize is LoaderOnResize.ERROR
    assert (opts.verify_checksums, opts.stage_before_apply, opts.timeout, opts.pause_gc) == (True, False, None, True)
    assert opts.storage == StorageOptions()
    assert [f.name for f in dataclasses.fields(LoadOptions)][:3] == ["io", "limits", "restore"]


@pytest.mark.parametrize("flat", sorted(FLAT))
def test_a_flat_keyword_lands_in_its_group_with_a_warning(flat: str) -> None:
    value, grouped = FLAT[flat]
    with pytest.warns(DeprecationWarning) as caught:
        opts = LoadOptions(**{flat: value})
    assert [str(w.message) for w in caught] == [f"LoadOptions({flat}=...) is deprecated: use {NEW_SPELLING[flat]}"]
    assert caught[0].filename == __file__  # points at the caller's line
    assert opts == grouped
    with pytest.warns(DeprecationWarning, match=rf"LoadOptions\.{flat} is deprecated"):
        assert getattr(opts, flat) == value  # reading the flat attribute: the group's field
    with pytest.warns(DeprecationWarning):
        assert dataclasses.replace(LoadOptions(), **{flat: value}) == grouped


@given(st.sets(st.sampled_from(sorted(FLAT))), st.sets(st.sampled_from(sorted(UNMOVED))))
def test_any_mix_of_flat_keywords_equals_the_grouped_spelling(flats: set[str], unmoved: set[str]) -> None:
    # the grouped spelling, from the literal values of FLAT and UNMOVED
    expected = LoadOptions(
        io=ReadOptions(
            threads=8 if "io_threads" in flats else 4,
            dedup_reads=True if "dedup_reads" in flats else None,
        ),
        limits=LoadLimits(
            max_metadata_bytes=1 << 20 if "max_metadata_bytes" in flats else 1 << 30,
            max_blob_bytes=4096 if "max_blob_bytes" in flats else 1 << 30,
        ),
        restore=RestoreOptions(
            key_map=_rename if "key_map" in flats else None,
            transforms=QKV if "transforms" in flats else (),
            cast_dtypes="cast_dtypes" in flats,
            extra_state_on_resize="rank0" if "extra_state_on_resize" in flats else "modulo",
            loader_on_resize="skip" if "loader_on_resize" in flats else "error",
        ),
        **{k: UNMOVED[k] for k in unmoved},
    )
    kwargs = {k: FLAT[k][0] for k in flats} | {k: UNMOVED[k] for k in unmoved}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert LoadOptions(**kwargs) == expected
    assert len(caught) == (1 if flats else 0)  # one warning per call, naming every flat keyword
    if flats:
        assert all(NEW_SPELLING[k] in str(caught[0].message) for k in flats)


def test_a_flat_keyword_with_its_group_overrides_that_field_only() -> None:
    with pytest.warns(DeprecationWarning):
        opts = LoadOptions(io=ReadOptions(threads=2, dedup_reads=False), io_threads=16)
    assert opts.io == ReadOptions(threads=16, dedup_reads=False)
    with pytest.warns(DeprecationWarning):
        opts = dataclasses.replace(opts, cast_dtypes=True)  # the other groups and fields are kept
    assert opts == LoadOptions(io=ReadOptions(threads=16, dedup_reads=False), restore=RestoreOptions(cast_dtypes=True))


def test_grouped_options_are_frozen_comparable_and_replaceable() -> None:
    opts = LoadOptions(io=ReadOptions(threads=8), restore=RestoreOptions(cast_dtypes=True), stage_before_apply=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the grouped spelling warns about nothing
        more = dataclasses.replace(opts, io=dataclasses.replace(opts.io, threads=16))
        assert more.io == ReadOptions(threads=16) and more.restore == opts.restore and more.stage_before_apply
        assert copy.deepcopy(opts) == opts
    for frozen, name in ((opts, "verify_checksums"), (opts.io, "threads"), (opts.limits, "max_blob_bytes")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(frozen, name, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.restore.cast_dtypes = False  # type: ignore[misc]
    assert {ReadOptions(threads=8), ReadOptions(threads=8), LoadLimits(), RestoreOptions()} == {
        ReadOptions(threads=8),
        LoadLimits(),
        RestoreOptions(),
    }
    assert opts != LoadOptions(io=ReadOptions(threads=8), stage_before_apply=True)


BAD = [  # (keywords, error type, message) as the flat LoadOptions gave them
    ({"extra_state_on_resize": "MODULO"}, ValueError, "extra_state_on_resize must be modulo, rank0, error or skip"),
    ({"extra_state_on_resize": None}, ValueError, "extra_state_on_resize must be modulo, rank0, error or skip"),
    ({"loader_on_resize": "modulo"}, ValueError, "loader_on_resize must be 'error' or 'skip'"),
    ({"loader_on_resize": ExtraStateOnResize.RANK0}, ValueError, "loader_on_resize must be 'error' or 'skip'"),
    ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds or None, got 0"),
    ({"timeout": float("inf")}, ValueError, "timeout must be a positive number of seconds or None, got inf"),
    ({"timeout": "5"}, ValueError, "timeout must be a positive number of seconds or None, got '5'"),
    ({"no_such_option": 1}, TypeError, "unexpected keyword argument 'no_such_option'"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD)
def test_refused_values_give_the_errors_they_gave(kwargs: dict[str, Any], error: type, message: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the refusal comes first, not a deprecation warning
        with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
            LoadOptions(**kwargs)
    grouped = {k: v for k, v in kwargs.items() if k in ("extra_state_on_resize", "loader_on_resize")}
    if grouped:  # the grouped spelling refuses them with the same words
        with pytest.raises(error, match=message):
            RestoreOptions(**grouped)


def test_a_group_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError, match=r"LoadOptions.io must be a ReadOptions, got \{'threads': 8\}"):
        LoadOptions(io={"threads": 8})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LoadOptions.restore must be a RestoreOptions, got ReadOptions"):
        LoadOptions(restore=ReadOptions(), cast_dtypes=True)  # type: ignore[arg-type]
