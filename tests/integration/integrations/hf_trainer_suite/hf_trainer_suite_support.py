"""What the Hugging Face Trainer's checkpoint tests build, written for unickpt's suite: a
one-feature regression problem ``y = 2x + 3 + noise`` (numpy-seeded, so every build gives the same
data), the model ``y = a*x + b`` as a ``PreTrainedModel`` (saved with ``config.json``) or as a
plain ``nn.Module``, and ``regression_trainer`` that builds the Trainer class the test asks for
(``UnickptTrainer`` unless told otherwise) around them. Upstream's tests build the same problem
in ``tests/trainer/trainer_test_utils.py`` (``RegressionDataset``, ``RegressionPreTrainedModel``,
``get_regression_trainer``); the scenarios of each test module name the upstream test they follow."""

from __future__ import annotations

import dataclasses
import math
import os
import random
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from unickpt.format.records import METADATA_FILE
from unickpt.integrations.hf_trainer import UNICKPT_SUBDIR, UnickptTrainer

# what the stock Trainer writes in checkpoint-N that unickpt writes as checkpoint-N/unickpt instead
STOCK_TRAINING_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt")
# what the Trainer writes in checkpoint-N itself, with unickpt as without
TRAINER_FILES = ("model.safetensors", "training_args.bin", "trainer_state.json")

# log entries that differ between an uninterrupted run and a resumed one (timings, and the mean
# loss of the steps this run took)
RUN_LOG_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")


class LineData:
    """``length`` samples ``{"input_x": x, "labels": 2x + 3 + noise}``, the same for the same seed."""

    def __init__(self, length: int = 64, seed: int = 42) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = (2 * self.x + 3 + rng.normal(scale=0.1, size=(length,))).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_x": self.x[i], "labels": self.y[i]}


class LineConfig(PretrainedConfig):
    model_type = "unickpt-line"

    def __init__(self, a: float = 0.0, b: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.a = a
        self.b = b
        self.hidden_size = 1


def _line_loss(a: torch.Tensor, b: torch.Tensor, input_x: torch.Tensor, labels: Any) -> tuple[torch.Tensor, ...]:
    y = input_x * a + b
    return (y,) if labels is None else (nn.functional.mse_loss(y, labels), y)


class LinePreTrained(PreTrainedModel):
    config_class = LineConfig
    base_model_prefix = "line"

    def __init__(self, config: LineConfig) -> None:
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(float(config.a)))
        self.b = nn.Parameter(torch.tensor(float(config.b)))
        self.post_init()

    def forward(self, input_x: torch.Tensor, labels: Any = None, **_: Any) -> tuple[torch.Tensor, ...]:
        return _line_loss(self.a, self.b, input_x, labels)


class LineModule(nn.Module):
    """The same model, not a ``PreTrainedModel`` (no ``config.json``)."""

    def __init__(self, a: float = 0.0, b: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a)))
        self.b = nn.Parameter(torch.tensor(float(b)))
        self.config = None

    def forward(self, input_x: torch.Tensor, labels: Any = None, **_: Any) -> tuple[torch.Tensor, ...]:
        return _line_loss(self.a, self.b, input_x, labels)


def regression_trainer(
    output_dir: str,
    *,
    train_len: int = 64,
    pretrained: bool = True,
    trainer_class: type[Trainer] = UnickptTrainer,
    a: float = 0.0,
    b: float = 0.0,
    callbacks: list[Any] | None = None,
    **args: Any,
) -> Trainer:
    """A Trainer (``trainer_class``) of the line model on ``LineData(train_len)``, evaluated on
    ``LineData(64)``, with ``TrainingArguments(output_dir, **args)`` (no reporting)."""
    model: nn.Module = LinePreTrained(LineConfig(a=a, b=b)) if pretrained else LineModule(a, b)
    arguments = TrainingArguments(output_dir, report_to=[], disable_tqdm=True, **args)
    trainer = trainer_class(
        model, arguments, train_dataset=LineData(train_len), eval_dataset=LineData(64), callbacks=callbacks
    )
    trainer.model_accepts_loss_kwargs = False  # the line model's loss takes no item count
    return trainer


def weights(trainer: Trainer) -> tuple[float, float]:
    return trainer.model.a.item(), trainer.model.b.item()


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def state_without_run_logs(trainer: Trainer) -> dict[str, Any]:
    """``trainer.state`` as a dict, less what differs between an uninterrupted and a resumed run."""
    state = dataclasses.asdict(trainer.state)
    state["log_history"] = [
        {k: v for k, v in entry.items() if k not in RUN_LOG_KEYS and not _is_nan(v)} for entry in state["log_history"]
    ]
    return state


def has_unickpt_checkpoint(checkpoint: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint, UNICKPT_SUBDIR, METADATA_FILE))


def assert_unickpt_checkpoints(output_dir: str, steps: range, *, pretrained: bool = True) -> None:
    """Each ``checkpoint-<step>`` holds what the Trainer writes itself and a unickpt checkpoint,
    and none of the stock Trainer's training-state files (upstream's ``check_saved_checkpoints``
    asks for ``optimizer.pt`` and ``scheduler.pt``: with unickpt they are in ``unickpt/``)."""
    for step in steps:
        checkpoint = os.path.join(output_dir, f"checkpoint-{step}")
        names = set(os.listdir(checkpoint))
        expected = set(TRAINER_FILES) | ({"config.json"} if pretrained else set())
        assert expected <= names, (checkpoint, sorted(names))
        assert has_unickpt_checkpoint(checkpoint), checkpoint
        assert not names & {*STOCK_TRAINING_STATE_FILES, "rng_state.pth"}, (checkpoint, sorted(names))


class NoisyLinePreTrained(LinePreTrained):
    """The line model plus noise from the torch, numpy and ``random`` generators in each forward
    (upstream's ``RegressionRandomPreTrainedModel``): a resume that does not restore the
    generators diverges from the uninterrupted run."""

    def forward(self, input_x: torch.Tensor, labels: Any = None, **_: Any) -> tuple[torch.Tensor, ...]:
        noise = 0.05 * (torch.randn(()) + float(np.random.rand()) + random.random())
        y = input_x * self.a + self.b + noise
        return (y,) if labels is None else (nn.functional.mse_loss(y, labels), y)
