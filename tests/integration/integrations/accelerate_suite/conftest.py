"""Accelerate's own ``tests/test_state_checkpointing.py`` (vendored, see its header) run against
``unickpt.integrations.accelerate``: ``Accelerator.save_state`` / ``load_state`` are replaced, for
each test, by unickpt's ``save_state`` / ``load_state`` (``safe_serialization`` does not apply:
unickpt never pickles; ``map_location`` does not either: unickpt loads in place). One process, no
process group, in the test's own working directory; each test leaves no pending save behind."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("accelerate")

from accelerate import Accelerator

import unickpt
from unickpt.integrations.accelerate import load_state, save_state


@pytest.fixture(autouse=True)
def unickpt_save_load_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)  # the relative-path test makes its folder in the working directory

    def save(self: Accelerator, output_dir: str | None = None, safe_serialization: bool = True, **_: Any) -> Any:
        return save_state(self, output_dir)

    def load(self: Accelerator, input_dir: str | None = None, load_kwargs: Any = None, **_: Any) -> None:
        load_state(self, input_dir)

    monkeypatch.setattr(Accelerator, "save_state", save)
    monkeypatch.setattr(Accelerator, "load_state", load)
    try:
        yield
    finally:
        unickpt.wait_all()
