"""Safe value encoding (extra state, dataloader state, optimizer objects): exact round trips.

``dumps_value`` -> ``loads_value`` must give back the same types and the same bits (tuples stay
tuples, int keys stay ints, tensors keep dtype / shape / bytes), RNG states must restore the exact
random streams, and decoding must refuse anything that would build other objects or run code.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import numpy as np
import pytest
import torch

import unickpt
from unickpt.errors import CorruptMetadataError
from unickpt.format import dumps_value, loads_value


def same(a: Any, b: Any) -> bool:
    """Deep equality that also checks types, dtypes and bits (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def roundtrip(v: Any) -> Any:
    data = dumps_value(v)
    json.loads(data)  # plain JSON, no pickle
    return loads_value(data)


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -7,
        2**63 - 1,
        2**64 - 1,
        -(2**63),
        2**80,
        -(2**90),
        1.5,
        -0.0,
        "text é ✓",
        "",
        [],
        {},
        (),
        [1, [2, [3]]],
        (1, "a", None, (2.5,)),
        {"a": (1, 2), "b": [None, {"c": 3}]},
        {0: "x", 5: (1,), -3: [2]},
        {1: {2: {3: "deep"}}},
        b"",
        b"\x00\xffbytes",
        bytearray(b"ba"),
    ],
)
def test_plain_values_round_trip(value: Any) -> None:
    got = roundtrip(value)
    expected = bytes(value) if isinstance(value, bytearray) else value
    assert same(got, expected), (got, expected)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_floats_round_trip(value: float) -> None:
    got = roundtrip({"x": value, "t": (value,)})
    assert same(got, {"x": value, "t": (value,)})
    assert b"Infinity" not in dumps_value(value) and b"NaN" not in dumps_value(value)  # strict JSON


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
    ],
)
def test_tensors_round_trip_bit_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g, dtype=torch.float64) * 100
    if dtype.is_complex:
        t = torch.complex(base.float(), -base.float()).to(dtype)
    elif dtype == torch.bool:
        t = base > 0
    else:
        t = base.to(dtype)
    got = roundtrip({"t": t, "nc": t.t(), "view": t[1:, 2:]})
    assert same(got["t"], t)
    assert same(got["nc"], t.t().contiguous())  # non-contiguous inputs are stored row-major
    assert same(got["view"], t[1:, 2:].contiguous())


def test_special_tensors_round_trip() -> None:
    values = {
        "scalar": torch.tensor(3.25),
        "bf16_scalar": torch.tensor(-1.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
        "nonfinite": torch.tensor([math.inf, -math.inf, math.nan, -0.0]),
        "step": torch.tensor(7, dtype=torch.int64),
    }
    got = roundtrip(values)
    for k, v in values.items():
        assert same(got[k], v), k
    assert got["scalar"].shape == ()


def test_numpy_values_round_trip() -> None:
    values = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "u32": np.array([1, 2**32 - 1], dtype=np.uint32),
        "be": np.arange(3, dtype=">i4"),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
        "empty": np.zeros((0, 2)),
        "bool": np.array([True, False]),
    }
    got = roundtrip(values)
    for k, v in values.items():
        assert same(got[k], np.ascontiguousarray(v)), k
        assert np.array_equal(got[k], v)
    assert got["be"].dtype == np.dtype(">i4")


def test_zero_d_numpy_array_round_trip() -> None:
    got = roundtrip(np.array(2.5))
    assert got.shape == () and got.item() == 2.5


def test_numpy_scalars_become_python_numbers() -> None:
    got = roundtrip({"i": np.int64(3), "f": np.float32(0.5), "b": np.bool_(True)})
    assert same(got, {"i": 3, "f": 0.5, "b": True})


def test_decoded_tensors_and_arrays_are_writable_copies() -> None:
    got = roundtrip({"t": torch.ones(3), "a": np.ones(3)})
    got["t"] += 1
    got["a"] += 1
    assert got["t"].tolist() == [2.0] * 3 and got["a"].tolist() == [2.0] * 3


def test_rng_state_restores_exact_streams() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)  # move the streams off their seeds
    state = unickpt.rng_state()
    expected = (
        random.random(),
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        random.getrandbits(64),
        np.random.randint(0, 1 << 30),
        torch.randint(0, 100, (4,)).tolist(),
    )
    restored = roundtrip({"rng": state})["rng"]
    for _ in range(5):  # scramble everything
        random.random(), np.random.rand(7), torch.rand(7)
    unickpt.set_rng_state(restored)
    got = (
        random.random(),
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        random.getrandbits(64),
        np.random.randint(0, 1 << 30),
        torch.randint(0, 100, (4,)).tolist(),
    )
    assert got == expected
    # the encoded state keeps its structure: python's is a tuple, numpy's a tuple with an array
    assert isinstance(restored["python"], tuple) and isinstance(restored["numpy"], tuple)
    assert isinstance(restored["numpy"][1], np.ndarray) and restored["numpy"][1].dtype == np.uint32
    assert same(restored["torch"], state["torch"])


def test_torch_generator_state_round_trip() -> None:
    g = torch.Generator().manual_seed(11)
    g.set_state(roundtrip(g.get_state()))
    a = torch.rand(4, generator=g)
    g2 = torch.Generator().manual_seed(11)
    assert torch.equal(a, torch.rand(4, generator=g2))


@pytest.mark.parametrize(
    "value,word",
    [
        (object(), "object"),
        ({"f": lambda: 1}, "function"),
        ({1: "a", "b": 2}, "keys"),
        ({"__unickpt__": 1}, "reserved"),
        (np.array([object()], dtype=object), "objects"),
        ({3.5: 1}, "keys"),
    ],
)
def test_encoding_refuses_unsafe_values(value: Any, word: str) -> None:
    with pytest.raises(TypeError, match=word):
        dumps_value(value)


def test_encoding_error_names_the_path() -> None:
    with pytest.raises(TypeError, match=r"extra_state\.sched\[1\]"):
        dumps_value({"sched": [1, object()]})


@pytest.mark.parametrize(
    "doc",
    [
        {"__unickpt__": "pickle", "v": "gASV"},
        {"__unickpt__": "tensor", "dtype": "float32", "shape": [2], "v": "AAAA"},  # 3 bytes for 8
        {"__unickpt__": "tensor", "dtype": "torch.FloatStorage", "shape": [0], "v": ""},
        {"__unickpt__": "ndarray", "dtype": "|O", "shape": [1], "v": "AAAAAAAAAAA="},
        {"__unickpt__": "ndarray", "dtype": "<f8", "shape": [2], "v": "AAAAAAAAAAA="},
        {"__unickpt__": "bytes", "v": "not base64!"},
        {"__unickpt__": "float", "v": "1e400"},
        {"__unickpt__": "float", "v": "__import__('os')"},
        {"__unickpt__": "tuple"},
        {"__unickpt__": "intdict", "v": [["x", 1]]},
        {"__unickpt__": "bigint", "v": "12ab"},
    ],
)
def test_decoding_refuses_bad_entries(doc: Any) -> None:
    with pytest.raises(CorruptMetadataError, match="rank0 extra"):
        loads_value(json.dumps({"outer": [doc]}).encode(), "rank0 extra")


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"[" * 100000])
def test_decoding_refuses_garbage(data: bytes) -> None:
    with pytest.raises(CorruptMetadataError, match="blob x"):
        loads_value(data, "blob x")


def test_decoding_refuses_deep_nesting() -> None:
    data = ("[" * 200 + "]" * 200).encode()
    with pytest.raises(CorruptMetadataError, match="too deep"):
        loads_value(data)


def test_encoding_refuses_deep_nesting() -> None:
    v: Any = 1
    for _ in range(100):
        v = [v]
    with pytest.raises(TypeError, match="deeper"):
        dumps_value(v)
