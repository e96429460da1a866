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
# tests/tests_pytorch/models/test_restore.py
# (the installed lightning 2.6.6 has no tag in the mirror; its source differs from 2.6.5 only in
# lightning/pytorch/core/saving.py). A selection of the upstream tests, run unchanged against unickpt's
# strategies (conftest.py substitutes them for Lightning's default strategy) except on the lines marked
# "# unickpt:", which read the checkpoint folder where Lightning read its one file.


import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_utilities.test.warning import no_warning_call

from tests.integration.integrations.lightning_suite.lightning_suite_support import read_checkpoint


class CustomException(Exception):  # unickpt: as in tests_pytorch/loops/test_loops.py
    pass


class ModelTrainerPropertyParity(Callback):
    def _check_properties(self, trainer, pl_module):
        assert trainer.global_step == pl_module.global_step
        assert trainer.current_epoch == pl_module.current_epoch

    def on_train_start(self, trainer, pl_module):
        self._check_properties(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, *_):
        self._check_properties(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, *_):
        self._check_properties(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._check_properties(trainer, pl_module)


def test_model_properties_fit_ckpt_path(tmp_path):
    """Test that properties like `current_epoch` and `global_step` in model and trainer are always the same."""
    model = BoringModel()
    checkpoint_callback = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer_args = {
        "default_root_dir": tmp_path,
        "max_epochs": 1,
        "limit_train_batches": 2,
        "limit_val_batches": 2,
        "logger": False,
        "callbacks": [checkpoint_callback, ModelTrainerPropertyParity()],  # this performs the assertions
    }
    trainer = Trainer(**trainer_args)
    trainer.fit(model)

    trainer_args.update(max_epochs=2)
    trainer = Trainer(**trainer_args)
    trainer.fit(model, ckpt_path=str(tmp_path / "last.ckpt"))


def test_correct_step_and_epoch(tmp_path):
    model = BoringModel()
    first_max_epochs = 2
    train_batches = 2
    trainer = Trainer(
        default_root_dir=tmp_path, max_epochs=first_max_epochs, limit_train_batches=train_batches, limit_val_batches=0
    )
    assert trainer.current_epoch == 0
    assert trainer.global_step == 0

    trainer.fit(model)
    assert trainer.current_epoch == first_max_epochs
    assert trainer.global_step == first_max_epochs * train_batches

    # save checkpoint after loop ends, training end called, epoch count increased
    ckpt_path = str(tmp_path / "model.ckpt")
    trainer.save_checkpoint(ckpt_path)

    ckpt = read_checkpoint(ckpt_path)  # unickpt: was Lightning's file
    assert ckpt["epoch"] == first_max_epochs
    assert ckpt["global_step"] == first_max_epochs * train_batches

    max_epochs = first_max_epochs + 2
    trainer = Trainer(
        default_root_dir=tmp_path, max_epochs=max_epochs, limit_train_batches=train_batches, limit_val_batches=0
    )
    # the ckpt state is not loaded at this point
    assert trainer.current_epoch == 0
    assert trainer.global_step == 0

    class TestModel(BoringModel):
        def on_train_start(self) -> None:
            assert self.trainer.current_epoch == first_max_epochs
            assert self.trainer.global_step == first_max_epochs * train_batches
            assert self.trainer.fit_loop.epoch_loop._batches_that_stepped == first_max_epochs * train_batches

    trainer.fit(TestModel(), ckpt_path=ckpt_path)
    assert trainer.current_epoch == max_epochs
    assert trainer.global_step == max_epochs * train_batches
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == max_epochs * train_batches


def test_fit_twice(tmp_path):
    epochs = []

    class TestModel(BoringModel):
        def on_train_epoch_end(self, *_):
            epochs.append(self.current_epoch)

    trainer = Trainer(
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(TestModel())
    trainer.fit_loop.max_epochs = 4
    trainer.fit(TestModel())
    assert epochs == [0, 1, 2, 3]


def test_try_resume_from_non_existing_checkpoint(tmp_path):
    """Test that trying to resume from non-existing `ckpt_path` fails with an error."""
    model = BoringModel()
    trainer = Trainer(logger=False)

    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        trainer.fit(model, ckpt_path=str(tmp_path / "non_existing.ckpt"))


class ExceptionModel(BoringModel):
    def __init__(self, stop_batch_idx):
        super().__init__()
        self.stop_batch_idx = stop_batch_idx

    def training_step(self, batch, batch_idx):
        if batch_idx == self.stop_batch_idx:
            raise CustomException()
        return super().training_step(batch, batch_idx)


class ShouldStopModel(ExceptionModel):
    def training_step(self, batch, batch_idx):
        if batch_idx == self.stop_batch_idx:
            # setting should_stop is treated differently to raising an exception.
            # checking both tests that this warning is raised in the correct loop
            self.trainer.should_stop = True
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("stop_in_the_middle", [True, False])
@pytest.mark.parametrize("model_cls", [ExceptionModel, ShouldStopModel])
def test_restarting_mid_epoch_raises_warning(tmp_path, stop_in_the_middle, model_cls):
    """Test that a warning is raised if training is restarted from mid-epoch."""
    limit_train_batches = 8
    trainer_kwargs = {
        "default_root_dir": tmp_path,
        "limit_train_batches": limit_train_batches,
        "limit_val_batches": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    trainer = Trainer(max_epochs=1, **trainer_kwargs)
    model = model_cls(limit_train_batches // 2 if stop_in_the_middle else -1)

    if stop_in_the_middle:
        with pytest.raises(CustomException):
            trainer.fit(model)
    else:
        trainer.fit(model)

    ckpt_path = str(tmp_path / "resume.ckpt")
    trainer.save_checkpoint(ckpt_path)

    trainer = Trainer(max_epochs=2, **trainer_kwargs)
    model.stop_batch_idx = -1

    context_manager = pytest.warns if stop_in_the_middle else no_warning_call
    with context_manager(UserWarning, match="resuming from a checkpoint that ended"):
        trainer.fit(model, ckpt_path=ckpt_path)

    if stop_in_the_middle:
        trainer = Trainer(max_epochs=2, **trainer_kwargs)
        with pytest.warns(UserWarning, match="resuming from a checkpoint that ended"):
            trainer.fit(model, ckpt_path=ckpt_path)


@pytest.mark.skip(reason="needs scikit-learn, not installed")
def test_trainer_properties_restore_ckpt_path():
    """Upstream test not run: see the reason."""


@pytest.mark.skip(reason="needs scikit-learn, not installed")
def test_callbacks_state_fit_ckpt_path():
    """Upstream test not run: see the reason."""


@pytest.mark.skip(reason="needs scikit-learn, not installed")
def test_callbacks_references_fit_ckpt_path():
    """Upstream test not run: see the reason."""


@pytest.mark.skip(reason="needs 2 CUDA GPUs")
def test_running_test_pretrained_model_distrib_ddp_spawn():
    """Upstream test not run: see the reason."""


@pytest.mark.skip(reason="needs scikit-learn, not installed")
def test_running_test_pretrained_model_cpu():
    """Upstream test not run: see the reason."""


@pytest.mark.skip(reason="LightningModule.load_from_checkpoint reads one file with torch.load, no strategy is asked")
def test_load_model_from_checkpoint():
    """Upstream test not run: see the reason."""


@pytest.mark.skip(reason="LightningModule.load_from_checkpoint reads one file with torch.load, no strategy is asked")
def test_model_saving_loading():
    """Upstream test not run: see the reason."""


@pytest.mark.skip(reason="LightningModule.load_from_checkpoint (torch.load of one file) and an HTTP fixture")
def test_strict_model_load_more_params():
    """Upstream test not run: see the reason."""


@pytest.mark.skip(reason="LightningModule.load_from_checkpoint (torch.load of one file) and an HTTP fixture")
def test_strict_model_load_less_params():
    """Upstream test not run: see the reason."""


@pytest.mark.skip(reason="pickles a model (cloudpickle), no checkpoint")
def test_model_pickle():
    """Upstream test not run: see the reason."""
