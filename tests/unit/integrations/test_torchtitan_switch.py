"""Issue 39 item 23: switching a torchtitan job to unickpt keeps every checkpoint field, in code
(docs/integrations/torchtitan.md's snippet) and from torchtitan's command line (its
``ConfigManager`` parses the documented flags; the overrides are applied as its ``Trainer``
applies them before building anything). One process; torchtitan's Trainer is not built (it
needs CUDA: tests/integration/integrations/test_torchtitan_trainer.py)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import pytest

pytest.importorskip("torchtitan.components.checkpointer")
pytest.importorskip("triton")  # torchtitan's models import it

from torchtitan.config import ConfigManager, apply_overrides
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from unickpt.integrations.torchtitan import UnickptCheckpointManager

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "integrations", "torchtitan.md")
TARGET = "unickpt.integrations.torchtitan.use_unickpt"
# the fields only unickpt's Config has, at their documented defaults (the RAM tier off)
OWN = {"dataloader_on_resize": "error", "unickpt_fast_root": "", "unickpt_replicas": 1,
       "unickpt_durable_every": None, "unickpt_keep_fast": 2}  # fmt: skip


def _fields(cfg: Any) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _job_fields() -> dict[str, Any]:
    """The debug model's own checkpoint settings (torchtitan's config function)."""
    job = _fields(llama3_debugmodel().checkpoint)
    assert job["last_save_model_only"] is False  # the field a fresh Config would turn True
    return job


def _cli(*flags: str) -> Any:
    config = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *flags])
    apply_overrides(config.override, config)  # as torchtitan's Trainer.__init__ does
    return config


def test_issue39_item23_command_line_selects_the_manager_and_keeps_every_field() -> None:
    config = _cli("--checkpoint.enable", "--checkpoint.interval", "7", "--override.imports", TARGET)
    ckpt = config.checkpoint
    assert type(ckpt) is UnickptCheckpointManager.Config
    assert type(ckpt)._owner is UnickptCheckpointManager  # what config.checkpoint.build() constructs
    want = {**_job_fields(), **OWN, "enable": True, "interval": 7}
    assert _fields(ckpt) == want


def test_issue39_item23_command_line_override_takes_unickpt_fields() -> None:
    config = _cli("--override.imports", f'{TARGET}={{"dataloader_on_resize": "skip"}}')
    assert type(config.checkpoint) is UnickptCheckpointManager.Config
    assert _fields(config.checkpoint) == {**_job_fields(), **OWN, "dataloader_on_resize": "skip"}


def test_issue39_item23_documented_snippet_keeps_every_field() -> None:
    text = open(DOC).read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "unickpt_config(" in b)
    code = "\n".join(line for line in block.splitlines() if ".build()" not in line)  # no CUDA here
    assert code != block  # the snippet builds the trainer; everything before it runs
    names: dict[str, Any] = {}
    exec(compile(code, "docs/integrations/torchtitan.md", "exec"), names)
    ckpt = names["config"].checkpoint
    assert type(ckpt) is UnickptCheckpointManager.Config
    want = {**_job_fields(), **OWN, "enable": True, "interval": 10, "async_mode": "async"}
    assert _fields(ckpt) == want


def test_issue40_item8_command_line_override_turns_the_ram_tier_on() -> None:
    # the documented flag (docs/integrations/torchtitan.md, "Fast recovery")
    tier = '{"unickpt_fast_root": "shm://llama3_8b", "unickpt_durable_every": 500}'
    config = _cli("--checkpoint.enable", "--override.imports", f"{TARGET}={tier}")
    want = {**_job_fields(), **OWN, "enable": True, "unickpt_fast_root": "shm://llama3_8b",
            "unickpt_durable_every": 500}  # fmt: skip
    assert _fields(config.checkpoint) == want
