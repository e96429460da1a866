"""``unickpt.save`` / ``unickpt.load`` / ``unickpt.wait_all``: the default ``Checkpointer``.

A thin facade: each call delegates to ``default_checkpointer()`` (see ``checkpointer``), which
runs the save and load pipelines (``engine.save.pipeline``, ``engine.load.pipeline``) and owns
what lives across calls. Jobs that want their own options, process group or lifetime (one per
role, tests) create ``unickpt.Checkpointer`` objects instead.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from .checkpointer import default_checkpointer, live_checkpointers
from .engine.export.hf import HFExportResult
from .engine.runtime.worker import SaveHandle
from .errors import AsyncSaveFailures
from .folder.target import check_role
from .format.hf_layout import HFExport
from .options import LoadOptions, SaveOptions

__all__ = ["save", "load", "wait_all", "export_hf", "SaveHandle", "check_role"]


def save(
    path: str,
    state: MutableMapping[str, Any],
    *,
    framework: str = "auto",
    async_save: bool = False,
    role: str | None = None,
    options: SaveOptions | None = None,
) -> SaveHandle:
    """``Checkpointer.save`` of the default checkpointer (see there)."""
    return default_checkpointer().save(
        path, state, framework=framework, async_save=async_save, role=role, options=options
    )


def load(
    path: str,
    state: MutableMapping[str, Any],
    *,
    framework: str = "auto",
    strict: bool = True,
    role: str | None = None,
    options: LoadOptions | None = None,
) -> None:
    """``Checkpointer.load`` of the default checkpointer (see there)."""
    default_checkpointer().load(path, state, framework=framework, strict=strict, role=role, options=options)


def export_hf(
    out: str,
    state: MutableMapping[str, Any],
    options: HFExport | None = None,
    *,
    framework: str = "auto",
    timeout: float | None = None,
) -> HFExportResult:
    """``Checkpointer.export_hf`` of the default checkpointer (see there)."""
    return default_checkpointer().export_hf(out, state, options, framework=framework, timeout=timeout)


def wait_all() -> None:
    """Block until every asynchronous save of this process (``unickpt.save``, every
    ``CheckpointManager`` and every open ``Checkpointer``) has committed or failed; raise one
    ``AsyncSaveFailures`` naming each failure nobody has seen yet. Call it (on every rank) before
    ``torch.distributed.destroy_process_group()``, which also destroys unickpt's groups."""
    failures: list[tuple[str, BaseException]] = []
    for ckpt in live_checkpointers():
        try:
            ckpt.wait()
        except AsyncSaveFailures as e:
            failures += e.failures
    if failures:
        raise AsyncSaveFailures(failures)
