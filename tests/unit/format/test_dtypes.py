"""``format.dtypes``: the torch-free name -> item size table agrees with torch for every name a
checkpoint may use, and the names map to torch dtypes and back."""

from __future__ import annotations

import pytest
import torch

from unickpt.errors import CorruptMetadataError
from unickpt.format.dtypes import DTYPE_NAMES, dtype_from_name, dtype_name, itemsize

# the names checkpoints have always used (format versions 1-3), in the order they were added
EXPECTED_NAMES = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
)  # fmt: skip


def test_the_names_are_the_stable_set() -> None:
    assert DTYPE_NAMES == EXPECTED_NAMES


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_itemsize_and_round_trip_agree_with_torch(name: str) -> None:
    dtype = getattr(torch, name)
    assert itemsize(name) == torch.empty(0, dtype=dtype).element_size()
    assert dtype_from_name(name) is dtype
    assert dtype_name(dtype) == name


def test_unknown_names_and_dtypes_are_refused() -> None:
    for bad in ("float128", "torch.float32", "", "Float32"):
        with pytest.raises(CorruptMetadataError, match="unknown dtype"):
            itemsize(bad)
        with pytest.raises(CorruptMetadataError, match="unknown dtype"):
            dtype_from_name(bad)
    with pytest.raises(TypeError, match="cannot store tensors of dtype"):
        dtype_name(torch.quint8)
