"""``engine.bytes_view``: the numpy fast path of ``tensor_bytes`` gives the bytes of the plain
uint8 view for every dtype, shape and layout, and ``sub_box`` of the whole tensor is the tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.engine.bytes_view import sub_box, tensor_bytes

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]


def _reference(t: torch.Tensor) -> bytes:
    """The plain path: a fresh row-major copy viewed as uint8."""
    t = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@settings(max_examples=examples(300), deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), max_size=3),
    layout=st.sampled_from(["plain", "transposed", "sliced", "offset", "grad", "expanded"]),
    seed=st.integers(0, 1 << 16),
)
def test_tensor_bytes_equals_the_uint8_view(dtype, shape, layout, seed):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(tuple(shape), generator=g) * 50).to(dtype)
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif layout == "sliced" and t.dim() >= 1:
        t = t[::2]
    elif layout == "offset" and t.numel() > 1:
        t = t.reshape(-1)[1:]
    elif layout == "grad" and dtype.is_floating_point and dtype not in (torch.float8_e4m3fn,):
        t = t.clone().requires_grad_(True)
    elif layout == "expanded" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    got = tensor_bytes(t)
    assert got.format == "B" and got.ndim == 1
    assert bytes(got) == _reference(t)


def test_tensor_bytes_of_a_0d_tensor_and_a_one_element_view_with_any_stride():
    assert bytes(tensor_bytes(torch.tensor(7.5))) == _reference(torch.tensor(7.5))
    odd = torch.arange(4, dtype=torch.bfloat16)[1::2][:1]  # shape (1,), stride (2,): "contiguous"
    assert bytes(tensor_bytes(odd)) == _reference(odd)
    with pytest.raises(ValueError, match="CPU"):
        tensor_bytes(torch.zeros(2, device="meta"))


def test_tensor_bytes_views_the_live_memory():
    t = torch.zeros(4, 3)
    view = tensor_bytes(t)
    t[1, 2] = 1.5
    assert bytes(view)[(1 * 3 + 2) * 4 : (1 * 3 + 3) * 4] == torch.tensor(1.5).numpy().tobytes()


def test_sub_box_of_the_whole_tensor_and_of_a_part():
    t = torch.arange(12).reshape(3, 4)
    assert sub_box(t, (0, 0), (3, 4)) is t
    assert torch.equal(sub_box(t, (1, 0), (2, 4)), t[1:])
    assert torch.equal(sub_box(t, (0, 1), (3, 2)), t[:, 1:3])
    assert sub_box(torch.tensor(3.0), (), ()).item() == 3.0
