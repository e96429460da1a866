"""unickpt's own regression tests beside the Trainer's (found by upstream's
``test_resume_batch_order``, see test_hf_trainer_upstream_resume.py): a buffer the model grows as
it trains has another shape in the checkpoint than in a fresh model. Accelerate's and the
Trainer's own loads hand it to the model's ``load_state_dict``, which may resize it; unickpt's
``load_state`` does the same inside its load (``RestoreOptions(resize_plain_tensors=True)``,
reading the metadata once), and a model whose ``load_state_dict`` does not resize raises
PyTorch's size-mismatch error, as with theirs."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from tests.fixtures.metadata_reads import count_metadata_reads
from unickpt.integrations.accelerate import load_state, save_state


class Recorder(nn.Module):
    """A linear layer and ``seen``, a buffer that grows by each batch's first feature."""

    def __init__(self, resizes: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.register_buffer("seen", torch.empty(0))
        self.resizes = resizes

    def load_state_dict(self, state_dict, strict=True, assign=False):  # type: ignore[no-untyped-def]
        if self.resizes and "seen" in state_dict and state_dict["seen"].shape != self.seen.shape:
            self.seen = torch.empty_like(state_dict["seen"])
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = torch.cat([self.seen, x[:, 0]])
        return self.fc(x)


def _trained(tmp_path) -> tuple[Recorder, str]:  # type: ignore[no-untyped-def]
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(Recorder(resizes=True))
    model(torch.arange(12.0).reshape(4, 3))
    save_state(accelerator, str(tmp_path / "ckpt"))
    return model, str(tmp_path / "ckpt")


def test_load_state_resizes_a_grown_buffer_through_the_models_load_state_dict(tmp_path) -> None:
    saved, path = _trained(tmp_path)
    accelerator = Accelerator(cpu=True)
    fresh = accelerator.prepare(Recorder(resizes=True))
    load_state(accelerator, path)
    assert torch.equal(fresh.seen, torch.tensor([0.0, 3.0, 6.0, 9.0]))  # the first features of the batch
    assert torch.equal(fresh.fc.weight, saved.fc.weight) and torch.equal(fresh.fc.bias, saved.fc.bias)


def test_load_state_of_a_grown_buffer_the_model_cannot_resize_raises_like_pytorch(tmp_path) -> None:
    _, path = _trained(tmp_path)
    accelerator = Accelerator(cpu=True)
    fresh = accelerator.prepare(Recorder(resizes=False))
    with pytest.raises(RuntimeError, match="size mismatch for seen"):
        load_state(accelerator, path)
    assert fresh.seen.shape == (0,)


def test_load_state_of_a_grown_buffer_reads_the_metadata_once(tmp_path) -> None:
    reads = count_metadata_reads("grownmd")
    _, path = _trained(tmp_path)
    accelerator = Accelerator(cpu=True)
    fresh = accelerator.prepare(Recorder(resizes=True))
    load_state(accelerator, f"grownmd://{path}")
    assert torch.equal(fresh.seen, torch.tensor([0.0, 3.0, 6.0, 9.0]))
    assert len(reads) == 1
