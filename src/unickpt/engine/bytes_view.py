"""Zero-copy byte views of tensors, and row-major sub-box views used by readers and writers."""

from __future__ import annotations

import torch

__all__ = ["tensor_bytes", "box_view", "sub_box"]


# dtypes numpy can view: their bytes come from ``Tensor.numpy()`` (~1.5 us; the uint8 view
# below costs ~4 us: 26,800 tensors are read and written through here per save or load)
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


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor in row-major order (copies only if not contiguous).

    Called per entry by the blocking save's ``staging.live_parts`` and by the load engine for
    each destination it reads into; the view keeps ``t``'s memory alive."""
    if not t.is_cpu:
        raise ValueError("tensor_bytes needs a CPU tensor")
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype in _NUMPY_DTYPES and not t.is_conj() and not t.is_neg():
        view = memoryview(t.numpy())
        if view.c_contiguous:
            return view.cast("B")
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
