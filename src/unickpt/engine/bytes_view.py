"""Zero-copy byte views of tensors, and row-major sub-box views used by readers and writers."""

from __future__ import annotations

import torch

__all__ = ["tensor_bytes", "box_view", "sub_box"]


# dtypes numpy can view; the others (bf16, fp8) are viewed as integers of their size first
_NUMPY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor in row-major order (copies only if not contiguous).

    Called per entry by the blocking save's ``staging.live_parts`` and by the load engine for
    each destination it reads into (while its reader threads run: every torch call that
    releases the GIL then waits to get it back, so the common case makes one call,
    ``Tensor.numpy()``); the view keeps ``t``'s memory alive."""
    dtype = t.dtype
    if dtype in _NUMPY_DTYPES or dtype.itemsize in _SAME_SIZE:
        try:  # refuses tensors that need grad, conjugate/negative views, other devices
            arr = (t if dtype in _NUMPY_DTYPES else t.view(_SAME_SIZE[dtype.itemsize])).numpy()
        except (RuntimeError, TypeError):
            arr = None
        if arr is not None and arr.flags.c_contiguous:
            if arr.size == 0:
                return memoryview(b"")
            return memoryview(arr).cast("B")  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
    if not t.is_cpu:
        raise ValueError("tensor_bytes needs a CPU tensor")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.as_strided((t.numel(),), (1,))  # contiguous: size-1 dims may have any stride
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+


def box_view(buf: torch.Tensor, dtype: torch.dtype, lengths: tuple[int, ...]) -> torch.Tensor:
    """View a uint8 buffer holding one row-major box as a tensor of ``lengths``."""
    return buf.view(dtype).view(lengths) if lengths else buf.view(dtype).view(())


def sub_box(t: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """The view of ``t`` at box (offsets, lengths) (offsets relative to ``t``)."""
    if t.shape == lengths and not any(offsets):  # the whole tensor (a shard read into its target)
        return t
    out = t
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[d]:
            out = out.narrow(d, o, n)
    return out
