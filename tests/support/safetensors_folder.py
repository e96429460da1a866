"""Read a Hugging Face safetensors folder back with the ``safetensors`` package alone (no unickpt):
the expected side of the HF export tests."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file


def read_safetensors_folder(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``folder`` (not its sub-folders), by name."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out
