# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.


#
# Vendored by unickpt from Lightning-AI/pytorch-lightning at tag 2.6.5, file
# tests/tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py
# (the installed lightning 2.6.6 has no tag in the mirror; its source differs from 2.6.5 only in
# lightning/pytorch/core/saving.py). A selection of the upstream tests, run unchanged against unickpt's
# strategies (conftest.py substitutes them for Lightning's default strategy) except on the lines marked
# "# unickpt:", which read the checkpoint folder where Lightning read its one file.


from unittest import mock

import pytest
import torch
from lightning.pytorch import Trainer, callbacks
from lightning.pytorch.demos.boring_classes import BoringModel

from unickpt import Checkpointer


@mock.patch.object(
    Checkpointer, "save", autospec=True, side_effect=Checkpointer.save
)  # unickpt: counts unickpt's saves where Lightning's counted torch.save
@pytest.mark.parametrize(
    ("epochs", "val_check_interval", "expected"), [(1, 1.0, 1), (2, 1.0, 2), (1, 0.25, 4), (2, 0.3, 6)]
)
def test_default_checkpoint_freq(save_mock, tmp_path, epochs: int, val_check_interval: float, expected: int):
    model = BoringModel()
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=epochs,
        enable_model_summary=False,
        val_check_interval=val_check_interval,
        limit_val_batches=1,
        enable_progress_bar=False,
    )
    trainer.fit(model)

    # make sure types are correct
    assert save_mock.call_count == expected


@mock.patch.object(
    Checkpointer, "save", autospec=True, side_effect=Checkpointer.save
)  # unickpt: counts unickpt's saves where Lightning's counted torch.save
@pytest.mark.parametrize(
    ("k", "epochs", "val_check_interval", "expected"), [(1, 1, 1.0, 1), (2, 2, 1.0, 2), (2, 1, 0.25, 4), (2, 2, 0.3, 6)]
)
@pytest.mark.parametrize("save_last", [False, True, "link"])
def test_top_k(save_mock, tmp_path, k, epochs, val_check_interval, expected, save_last):
    class TestModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.last_coeff = 10.0

        def training_step(self, batch, batch_idx):
            loss = self.step(torch.ones(32, device=self.device))
            loss = loss / (loss + 0.0000001)
            loss += self.last_coeff
            self.log("my_loss", loss)
            self.last_coeff *= 0.999
            return loss

    model = TestModel()
    trainer = Trainer(
        callbacks=[callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="my_loss", save_top_k=k, save_last=save_last)],
        default_root_dir=tmp_path,
        max_epochs=epochs,
        enable_model_summary=False,
        val_check_interval=val_check_interval,
    )
    trainer.fit(model)

    # save_last=True: last epochs are saved every step (so double the save calls)
    expected = expected * 2 if save_last is True else expected
    assert save_mock.call_count == expected


@pytest.mark.skip(reason="needs 2 CUDA GPUs")
def test_top_k_ddp():
    """Upstream test not run: see the reason."""


@pytest.mark.skip(reason="needs 2 CUDA GPUs")
def test_model_checkpoint_ddp_monitor_none():
    """Upstream test not run: see the reason."""
