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
from hypothesis import given, settings
from hypothesis import strategies as st

import unickpt
from tests.support.hypothesis_profiles import examples
from unickpt.errors import CorruptMetadataError
from unickpt.format import dumps_value, loads_value


def same_dtype(a: np.dtype, b: np.dtype) -> bool:
    """numpy's == ignores alignment flags and some layout details: compare those too."""
    return a == b and a.str == b.str and a.descr == b.descr and a.isalignedstruct == b.isalignedstruct


def same(a: Any, b: Any) -> bool:
    """Deep equality that also checks types, dtypes and bits (NaN equals NaN, -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.requires_grad == b.requires_grad
            and torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))
        )
    if isinstance(a, np.ndarray):
        if not (same_dtype(a.dtype, b.dtype) and a.shape == b.shape):
            return False
        if a.dtype.names:  # field by field: padding bytes between fields hold no value
            return all(same(a[name], b[name]) for name in a.dtype.names)
        return a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return same(np.asarray(a), np.asarray(b))
    if isinstance(a, np.dtype):
        return same_dtype(a, b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)
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
    assert same(got, value), (got, value)  # a bytearray stays a bytearray (issue 10 item 9)


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


def test_numpy_scalars_stay_numpy_scalars() -> None:
    """Issue 10 item 9 changed this: numpy scalars used to come back as Python numbers."""
    got = roundtrip({"i": np.int64(3), "f": np.float32(0.5), "b": np.bool_(True)})
    assert same(got, {"i": np.int64(3), "f": np.float32(0.5), "b": np.bool_(True)})
    assert [type(x) for x in got.values()] == [np.int64, np.float32, np.bool_]


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


# --------------------------------------------------------------------------- issue 10 item 9: exact types

POINT = np.dtype([("x", "<f4"), ("y", ">i8", (2,)), ("tag", "S3")])
NESTED = np.dtype([("id", "<u2"), ("pos", POINT), ("when", "<M8[ms]"), ("pad", "|V3")], align=True)


def test_item9_extra_state_values_come_back_with_their_type() -> None:
    """Issue 10 item 9: structured arrays used to come back as raw ``|V12`` bytes, numpy scalars
    as Python numbers, bytearray as bytes, torch.Size as a tuple, OrderedDict as dict."""
    from collections import OrderedDict

    records = np.zeros(3, dtype=NESTED)
    records["id"] = [1, 2, 3]
    records["pos"]["y"] = [[1, -2], [3, -4], [5, -6]]
    records["pos"]["tag"] = [b"a", b"bc", b"def"]
    records["when"] = np.array(["2024-05-01T12:00:00.123", "NaT", "1969-12-31"], dtype="M8[ms]")
    value = {
        "packed": np.array([(1, 2.0)], dtype=[("i", "<i4"), ("f", "<f8")]),
        "records": records,
        "aligned_view": records[::2],  # non-contiguous: stored C-order
        "point": records[1]["pos"],  # a structured np.void scalar
        "f32": np.float32(1.5),
        "i64": np.int64(-3),
        "u8": np.uint8(255),
        "b": np.bool_(False),
        "c64": np.complex64(1 - 2j),
        "half": np.float16(0.1),
        "day": np.datetime64("2024-02-29", "D"),
        "gap": np.timedelta64(-7, "ms"),
        "word": np.str_("héllo"),
        "raw": np.bytes_(b"\x00x"),
        "dtype": NESTED,
        "ba": bytearray(b"\x00buf"),
        "size": torch.Size([2, 0, 3]),
        "od": OrderedDict([("z", 1), (3, "int key"), ("a", OrderedDict())]),
        "set": {1, "two", (3, 4), frozenset({5})},
        "frozen": frozenset({b"x", 2.5}),
        "complex": complex(math.inf, -0.0),
        "torch_dtype": torch.bfloat16,
        "device": torch.device("cuda", 1),
        "param": torch.nn.Parameter(torch.arange(4.0)),
        "frozen_param": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "grad_leaf": torch.zeros(3).requires_grad_(),
    }
    got = roundtrip(value)
    assert list(got) == list(value)
    for key, v in value.items():
        expected = np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v
        assert same(got[key], expected), (key, got[key], expected)
    assert got["records"]["pos"]["tag"].tolist() == [b"a", b"bc", b"def"]
    assert type(got["point"]) is np.void and got["point"]["y"].tolist() == [3, -4]
    rec = got["records"].dtype
    assert rec.isalignedstruct and rec.fields["when"][1] == 32 and rec.itemsize == 48
    assert type(got["param"]) is torch.nn.Parameter and got["param"].requires_grad
    assert type(got["frozen_param"]) is torch.nn.Parameter and not got["frozen_param"].requires_grad
    assert got["grad_leaf"].requires_grad and got["grad_leaf"].is_leaf
    assert dumps_value(value) == dumps_value(got)  # stable bytes (sets are written sorted)


def test_tensor_views_come_back_contiguous_on_the_cpu() -> None:
    """Documented: strides, storage sharing, conjugate bits and autograd history are not kept."""
    base = torch.arange(12.0).reshape(3, 4).requires_grad_()
    z = torch.complex(torch.arange(3.0), torch.ones(3))
    got = roundtrip({"t": base.t(), "h": base * 2, "conj": z.conj(), "neg": z.conj().imag})
    assert same(got["t"], base.t().detach().contiguous().requires_grad_())
    assert got["t"].is_contiguous() and got["h"].is_leaf and got["h"].requires_grad
    assert not got["conj"].is_conj() and torch.equal(got["conj"], z.conj().resolve_conj())
    assert torch.equal(got["neg"], -torch.ones(3))


class _Sub(torch.Tensor):
    pass


def _refusals() -> list[tuple[Any, str]]:
    import collections
    import enum

    class Color(enum.IntEnum):
        RED = 1

    pair = collections.namedtuple("pair", "a b")
    return [
        (pair(1, 2), "namedtuple pair"),
        (collections.defaultdict(int), "subclass of dict"),
        (Color.RED, "subclass of int"),
        (np.ma.masked_array(np.eye(2)), r"np\.asarray"),
        (torch.ones(2).as_subclass(_Sub), "tensor subclass _Sub"),
        (torch.eye(2).to_sparse(), "to_dense"),
        (torch.empty(2, device="meta"), "meta device"),
        (np.zeros(2, dtype=[("a", "<i4"), ("o", "O")]), "objects"),
        (np.zeros(2, dtype=[("s", [("deep", "O")])]), "objects"),
        (np.zeros(2, dtype={"names": ["a"], "formats": ["<i4"], "titles": ["A"]}), "title"),
        (np.zeros(2, dtype=np.dtype("<i4", metadata={"unit": "m"})), "metadata"),
        (np.zeros(2, dtype=[]), "no bytes"),
        (10**5000, "too large"),
        ({frozenset({1}), object()}, r"\{\}"),
        (__import__("collections").OrderedDict([((1, 2), 3)]), "keys"),
        (__import__("datetime").date(2024, 1, 1), "type date"),
    ]


@pytest.mark.parametrize("value,words", _refusals(), ids=lambda x: type(x).__name__ if not isinstance(x, str) else "")
def test_item9_unsupported_values_are_refused_at_save_with_their_path(value: Any, words: str) -> None:
    with pytest.raises(TypeError, match=r"extra_state\.x\[0\]") as ei:
        dumps_value({"x": [value]})
    assert __import__("re").search(words, str(ei.value)), str(ei.value)


GOLDEN = (
    '{"step":7,"lr":0.5,"name":"run","none":null,"flag":true,'
    '"big":{"__unickpt__":"bigint","v":"1180591620717411303424"},'
    '"neg":{"__unickpt__":"bigint","v":"-36893488147419103232"},'
    '"inf":{"__unickpt__":"float","v":"inf"},"nan":{"__unickpt__":"float","v":"nan"},'
    '"tup":{"__unickpt__":"tuple","v":[1,{"__unickpt__":"tuple","v":[2.5,"x"]}]},'
    '"ids":{"__unickpt__":"intdict","v":[[3,"a"],[-1,[1]]]},'
    '"raw":{"__unickpt__":"bytes","v":"AP8="},"ba":{"__unickpt__":"bytes","v":"YmE="},'
    '"t":{"__unickpt__":"tensor","dtype":"float32","shape":[2,2],"v":"AAAAAAAAgD8AAABAAABAQA=="},'
    '"h":{"__unickpt__":"tensor","dtype":"bfloat16","shape":[],"v":"wL8="},'
    '"e":{"__unickpt__":"tensor","dtype":"int64","shape":[0,3],"v":""},'
    '"a":{"__unickpt__":"ndarray","dtype":">i4","shape":[3],"v":"AAAAAAAAAAEAAAAC"},'
    '"z":{"__unickpt__":"ndarray","dtype":"<f8","shape":[],"v":"AAAAAAAABEA="},'
    '"when":{"__unickpt__":"ndarray","dtype":"<M8[D]","shape":[1],"v":"DE0AAAAAAAA="},'
    '"rec":{"__unickpt__":"ndarray","dtype":"|V12","shape":[1],"v":"AQAAAAAAAAAAAABA"},'
    '"np_f32":1.5,"np_i64":3,"np_b":true,"size":{"__unickpt__":"tuple","v":[2,3]},"od":{"b":1,"a":2}}'
)


def test_values_written_before_the_new_tags_decode_as_before() -> None:
    """GOLDEN is what the encoder before issue 10 item 9 wrote for a dict holding, among others,
    a bytearray, a structured array, numpy scalars, a torch.Size and an OrderedDict: it decodes
    exactly as it did then (the old encoder had already dropped those types)."""
    import struct

    expected = {
        "step": 7,
        "lr": 0.5,
        "name": "run",
        "none": None,
        "flag": True,
        "big": 2**70,
        "neg": -(2**65),
        "inf": math.inf,
        "nan": math.nan,
        "tup": (1, (2.5, "x")),
        "ids": {3: "a", -1: [1]},
        "raw": b"\x00\xff",
        "ba": b"ba",
        "t": torch.tensor([[0.0, 1.0], [2.0, 3.0]]),
        "h": torch.tensor(-1.5, dtype=torch.bfloat16),
        "e": torch.empty(0, 3, dtype=torch.int64),
        "a": np.array([0, 1, 2], dtype=">i4"),
        "z": np.array(2.5),
        "when": np.array(["2024-01-02"], dtype="<M8[D]"),
        "rec": np.frombuffer(struct.pack("<id", 1, 2.0), dtype="|V12").copy(),
        "np_f32": 1.5,
        "np_i64": 3,
        "np_b": True,
        "size": (2, 3),
        "od": {"b": 1, "a": 2},
    }
    got = loads_value(GOLDEN.encode())
    assert same(got, expected), got


# --------------------------------------------------------------------------- property test

_PLAIN_NP = ["<f4", ">f8", "<f2", "|b1", "<i8", ">i2", "|u1", "<u4", "<c8", ">c16", "<M8[s]", "<m8[ms]", "|S3", "<U2"]


def _np_dtypes() -> st.SearchStrategy[np.dtype]:
    plain = st.sampled_from(_PLAIN_NP + ["|V5"]).map(np.dtype)

    def structured(children: st.SearchStrategy[np.dtype]) -> st.SearchStrategy[np.dtype]:
        field = st.tuples(children, st.sampled_from([(), (2,), (1, 3)]))
        return st.builds(
            lambda fields, align: np.dtype([(f"f{i}", dt, shape) for i, (dt, shape) in enumerate(fields)], align=align),
            st.lists(field, min_size=1, max_size=3),
            st.booleans(),
        )

    return st.recursive(plain, structured, max_leaves=6)


@st.composite
def _arrays(draw: Any) -> np.ndarray:
    dt = draw(_np_dtypes())
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    data = draw(st.binary(min_size=math.prod(shape) * dt.itemsize, max_size=math.prod(shape) * dt.itemsize))
    return np.frombuffer(data, dtype=dt).reshape(shape).copy()


@st.composite
def _tensors(draw: Any) -> torch.Tensor:
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.uint8]))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    t = torch.randn(shape, generator=g) * 100
    t = t > 0 if dtype == torch.bool else t.to(dtype)
    if dtype.is_floating_point and draw(st.booleans()):
        return torch.nn.Parameter(t, requires_grad=draw(st.booleans()))
    return t.requires_grad_(dtype.is_floating_point and draw(st.booleans()))


_HASHABLE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=4) | st.binary(max_size=4),
    lambda c: st.lists(c, max_size=3).map(tuple) | st.frozensets(c, max_size=3),
    max_leaves=6,
)
_LEAVES = (
    _HASHABLE
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.complex_numbers(allow_nan=True, allow_infinity=True)
    | st.binary(max_size=6).map(bytearray)
    | st.lists(st.integers(0, 5), max_size=4).map(torch.Size)
    | st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.complex64, torch.bool])
    | st.sampled_from([torch.device("cpu"), torch.device("cuda", 3), torch.device("meta")])
    | _np_dtypes()
    | _arrays()
    | _arrays().filter(lambda a: a.size > 0).map(lambda a: a.reshape(-1)[0])  # numpy scalars
    | _tensors()
)
_KEYS = st.text(max_size=5).filter(lambda k: k != "__unickpt__")


def _containers(c: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    from collections import OrderedDict

    return (
        st.lists(c, max_size=3)
        | st.lists(c, max_size=3).map(tuple)
        | st.dictionaries(_KEYS, c, max_size=3)
        | st.dictionaries(st.integers(-5, 5), c, min_size=1, max_size=3)
        | st.lists(st.tuples(_KEYS | st.integers(-5, 5), c), max_size=3).map(OrderedDict)
        | st.sets(_HASHABLE, max_size=3)
        | st.frozensets(_HASHABLE, max_size=3)
    )


@settings(max_examples=examples(150), deadline=None, derandomize=True, database=None)
@given(st.recursive(_LEAVES, _containers, max_leaves=10))
def test_item9_values_round_trip_with_type_identity(value: Any) -> None:
    """Any nesting of supported values comes back equal, bit for bit, with the same types
    (numpy scalars and dtypes, structured arrays, Parameters, OrderedDicts, sets ...)."""
    got = roundtrip(value)
    expected = np.require(value, requirements="C") if isinstance(value, np.ndarray) else value
    assert same(got, expected), (value, got)


# --------------------------------------------------------------------------- issue 9 item 12: decoding


def _t(shape: Any, v: str = "", dtype: str = "float32", **extra: Any) -> dict[str, Any]:
    return {"__unickpt__": "tensor", "dtype": dtype, "shape": shape, "v": v, **extra}


def _a(dtype: Any, shape: Any, v: str = "", tag: str = "ndarray") -> dict[str, Any]:
    return {"__unickpt__": tag, "dtype": dtype, "shape": shape, "v": v}


MALFORMED = {
    "tensor negative dims": _t([-1, -1], "AAAAAA=="),  # used to escape as RuntimeError
    "tensor negative dim, empty": _t([0, -5]),
    "tensor absurd dim, empty": _t([0, 2**70]),
    "tensor absurd dims": _t([0, 2**40, 2**40]),
    "tensor bool dim": _t([True], "AAAAAA=="),
    "tensor float dim": _t([1.0], "AAAAAA=="),
    "tensor too many dims": _t([1] * 65, "AAAAAA=="),
    "int tensor with grad": _t([1], "AAAAAAAAAAA=", "int64", requires_grad=True),
    "grad flag not bool": _t([1], "AAAAAA==", requires_grad=1),
    "tensor payload not a string": _t([1], ["AAAAAA=="]),  # type: ignore[arg-type]
    "array negative dims": _a("<f8", [-2, -1], "AAAAAAAAAAAAAAAAAAAAAA=="),
    "array object dtype": _a("|O", [1], "AAAAAAAAAAA="),
    "array dtype by name": _a("object", [1], "AAAAAAAAAAA="),
    "array non-canonical dtype": _a("float64", [1], "AAAAAAAAAAA="),
    "array dtype list": _a("<i4,<i4", [1], "AAAAAAAAAAA="),
    "array object field": _a({"fields": [["a", "|O", 0]], "itemsize": 8, "aligned": False}, [1], "AAAAAAAAAAA="),
    "array field offset outside": _a({"fields": [["a", "<f8", 4]], "itemsize": 8, "aligned": False}, [0]),
    "array zero itemsize": _a("|V0", [3]),
    "array subarray element": _a({"sub": "<i4", "shape": [2]}, [1], "AAAAAAAAAAA="),
    "array absurd subarray": _a({"sub": "<f8", "shape": [2**40]}, [0]),
    "deep dtype": _a(json.loads('{"sub": ' * 40 + '"<i4"' + ', "shape": [1]}' * 40), [0]),
    "scalar short payload": _a("<f4", None, "AAA=", "npscalar"),
    "scalar long payload": _a("<f4", None, "AAAAAAAA", "npscalar"),
    "bigint absurd length": {"__unickpt__": "bigint", "v": "9" * 5000},
    "bigint spaces": {"__unickpt__": "bigint", "v": " 12"},
    "bigint underscores": {"__unickpt__": "bigint", "v": "1_000"},
    "bigint number": {"__unickpt__": "bigint", "v": 12},
    "bytes not a string": {"__unickpt__": "bytes", "v": 5},
    "bytearray bad base64": {"__unickpt__": "bytearray", "v": "!!"},
    "size float": {"__unickpt__": "size", "v": [1.5]},
    "size absurd": {"__unickpt__": "size", "v": [2**70]},
    "device injection": {"__unickpt__": "device", "v": "cuda:0; rm -rf /"},
    "device unknown": {"__unickpt__": "device", "v": "nosuchdevice"},
    "torch dtype unknown": {"__unickpt__": "torch_dtype", "v": "torch.FloatStorage"},
    "odict duplicate key": {"__unickpt__": "odict", "v": [["a", 1], ["a", 2]]},
    "odict float key": {"__unickpt__": "odict", "v": [[1.5, 1]]},
    "intdict string key": {"__unickpt__": "intdict", "v": [["1", 1]]},
    "set of lists": {"__unickpt__": "set", "v": [[1]]},
    "complex of ints": {"__unickpt__": "complex", "v": [1, 2]},
    "complex one part": {"__unickpt__": "complex", "v": [1.5]},
    "float not a string": {"__unickpt__": "float", "v": ["inf"]},
    "tag not a string": {"__unickpt__": ["tuple"], "v": []},
    "tag null": {"__unickpt__": None},
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_item12_malformed_values_are_corrupt_metadata(case: str) -> None:
    """Issue 9 item 12: only CheckpointError leaves decoding (a negative dimension in a tagged
    tensor used to escape as RuntimeError)."""
    with pytest.raises(CorruptMetadataError, match="rank0 extra"):
        loads_value(json.dumps({"outer": [MALFORMED[case]]}).encode(), "rank0 extra")


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b'{"x": [NaN]}'])
def test_item12_non_json_number_literals_are_refused(literal: bytes) -> None:
    """The encoder writes strict JSON (non-finite floats are tagged), so these never come from it."""
    with pytest.raises(CorruptMetadataError, match="not valid JSON"):
        loads_value(literal, "blob")


def test_item9_extra_state_round_trips_through_save_and_load(tmp_path: Any) -> None:
    """Through real files: ``unickpt.save`` then ``unickpt.load`` give back the same types."""
    from collections import OrderedDict

    model = torch.nn.Linear(2, 2)
    extra = {
        "records": np.array([(1, 2.5)], dtype=[("i", "<i4"), ("f", "<f8")]),
        "f32": np.float32(1.5),
        "ba": bytearray(b"\x01\x02"),
        "size": torch.Size([4, 2]),
        "od": OrderedDict([("b", 1), ("a", 2)]),
        "rng": unickpt.rng_state(),
    }
    unickpt.save(str(tmp_path / "ck"), {"model": model, "extra_state": extra}, framework="torch")
    state: dict[str, Any] = {"model": torch.nn.Linear(2, 2), "extra_state": None}
    unickpt.load(str(tmp_path / "ck"), state, framework="torch")
    assert same(state["extra_state"], extra)
    with pytest.raises(TypeError, match=r"extra_state\.bad: max is a subclass of tuple"):
        unickpt.save(str(tmp_path / "ck2"), {"model": model, "extra_state": {"bad": torch.max(torch.ones(2), 0)}})
