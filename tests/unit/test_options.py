"""``LoadOptions`` grouped (issue 29, item 6): ``io=ReadOptions``, ``limits=LoadLimits``,
``restore=RestoreOptions``; refused values give the errors they gave. The flat keywords of
the development versions and their DeprecationWarning shim went before the first release (issue 41).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import pytest

from unickpt import LoadOptions
from unickpt.options import ExtraStateOnResize, LoaderOnResize, LoadLimits, ReadOptions, RestoreOptions
from unickpt.storage import StorageOptions


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
            grouped = {k: v for k, v in kwargs.items() if k in ("extra_state_on_resize", "loader_on_resize")}
            if grouped:  # refused by their group, in LoadOptions(restore=...) as on their own
                LoadOptions(restore=RestoreOptions(**grouped))
            else:
                LoadOptions(**kwargs)
    if grouped:
        with pytest.raises(error, match=message):
            RestoreOptions(**grouped)


def test_a_group_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError, match=r"LoadOptions.io must be a ReadOptions, got \{'threads': 8\}"):
        LoadOptions(io={"threads": 8})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LoadOptions.restore must be a RestoreOptions, got ReadOptions"):
        LoadOptions(restore=ReadOptions())  # type: ignore[arg-type]


FLAT = ["io_threads", "dedup_reads", "max_metadata_bytes", "max_blob_bytes", "key_map", "transforms", "cast_dtypes"]
FLAT += ["extra_state_on_resize", "loader_on_resize"]  # the flat keywords of the development versions


@pytest.mark.parametrize("flat", FLAT)
def test_issue41_item3_load_options_take_no_flat_keywords(flat: str) -> None:
    """The DeprecationWarning shim is gone (nothing was released with the flat spelling): a flat
    keyword is an unknown keyword, a flat attribute does not exist."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{flat}'"):
            LoadOptions(**{flat: None})
        assert not hasattr(LoadOptions, flat) and not hasattr(LoadOptions(), flat)
