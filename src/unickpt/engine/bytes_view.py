"""Zero-copy byte views of tensors, and row-major sub-box views used by readers and writers."""

from __future__ import annotations

import torch

__all__ = ["tensor_bytes", "box_view", "sub_box"]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor in row-major order (copies only if not contiguous)."""
    if t.device.type != "cpu":
        raise ValueError("tensor_bytes needs a CPU tensor")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+


def box_view(buf: torch.Tensor, dtype: torch.dtype, lengths: tuple[int, ...]) -> torch.Tensor:
    """View a uint8 buffer holding one row-major box as a tensor of ``lengths``."""
    return buf.view(dtype).view(lengths) if lengths else buf.view(dtype).view(())


def sub_box(t: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """The view of ``t`` at box (offsets, lengths) (offsets relative to ``t``)."""
    out = t
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[d]:
            out = out.narrow(d, o, n)
    return out
