"""The RAM tier (``TieredCheckpointManager`` with replicas, docs/guide/recovery.md) behind the
integrations whose checkpoints are named by path (the Lightning strategies, the HF Trainer
mixin): their knobs (``TierKnobs``), and the small *step marker* that maps such a path to a
tier step.

How a path maps to a step: the framework names each save by a path (``checkpoint-500/``,
``epoch=0-step=500.ckpt``); with the tier on, the state goes to the tier as step ``N`` (the
global step) and the path gets only the marker ``{"format": "unickpt-tier-step/1", "step": N}``
(a file of its own: ``<folder>/unickpt-tier.json`` for a folder, the path itself for a file
name). Resuming from that path reads the marker and loads step ``N`` through
``TieredCheckpointManager.load_latest``, which must agree that ``N`` is the newest recoverable
step (``load_step``); the framework's retention of paths deletes the marker only (the tier keeps
its own retention: ``keep_fast`` in RAM, ``keep_durable`` on the durable tier).

Called by ``integrations.hf_trainer`` and ``integrations.lightning``.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from .. import TieredCheckpointManager
from ..errors import ConfigurationError, IncompleteCheckpointError, StorageError
from ..storage import open_storage

__all__ = ["TierKnobs", "MARKER_NAME", "write_step_marker", "read_step_marker", "load_step"]

MARKER_NAME = "unickpt-tier.json"  # inside a checkpoint folder (the HF Trainer's checkpoint-N)
_FORMAT = "unickpt-tier-step/1"
_LIMIT = 4096


@dataclass(frozen=True)
class TierKnobs:
    """The tier's options as an integration takes them. ``fast_root`` ``""``: the tier is off
    (saves go to the framework's paths as before); else ``shm://<name>``, each host's RAM.
    ``durable_root``: the tier's durable folder (None: the integration's default beside its
    checkpoints)."""

    fast_root: str = ""
    durable_root: str | None = None
    replicas: int = 1
    durable_every: int | None = None
    keep_fast: int = 2

    def __post_init__(self) -> None:
        if self.fast_root and not self.fast_root.startswith("shm://"):
            raise ConfigurationError(f"the RAM tier's fast root must be shm://<name>, got {self.fast_root!r}")
        if self.fast_root and self.replicas < 1:
            raise ConfigurationError(f"the RAM tier needs replicas >= 1, got {self.replicas}")

    @property
    def on(self) -> bool:
        return bool(self.fast_root)

    def build(self, default_durable: str) -> TieredCheckpointManager:
        """The tier (every rank, together: its construction is collective)."""
        return TieredCheckpointManager(
            self.fast_root,
            self.durable_root or default_durable,
            replicas=self.replicas,
            durable_every=self.durable_every,
            keep_fast=self.keep_fast,
        )


def write_step_marker(path: str, step: int) -> None:
    """Write the marker of ``step`` at ``path`` (one rank): a new file, or one replacing a marker
    of ours; anything else at ``path`` is refused, never overwritten."""
    if os.path.lexists(path) and read_step_marker(path) is None:
        raise StorageError(
            errno.EEXIST, f"{path} exists and is not a unickpt tier-step marker: the RAM tier never overwrites it"
        )
    folder, name = os.path.split(os.path.abspath(path))
    storage = open_storage(folder)  # the folder's files: exclusive create, no link followed
    part = f"{name}.unickpt-part"
    if storage.size(part) is not None:
        storage.delete([part])  # ours, left by a killed save
    storage.write(part, [json.dumps({"format": _FORMAT, "step": int(step)}).encode()])
    storage.rename(part, name)
    storage.sync()


def read_step_marker(path: str) -> int | None:
    """The step of the marker at ``path``, or None when there is none (no file, a link, a folder,
    another file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        raw = os.read(fd, _LIMIT + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        rec = json.loads(raw) if len(raw) <= _LIMIT else None
    except ValueError:
        return None
    if not isinstance(rec, dict) or rec.get("format") != _FORMAT or type(rec.get("step")) is not int:
        return None
    return int(rec["step"])


def load_step(tiers: TieredCheckpointManager, step: int, where: str, state: MutableMapping[str, Any],
              **kwargs: Any) -> None:  # fmt: skip
    """Load ``step`` (named by the marker at ``where``) from the tier into ``state`` (every rank):
    it must be the tier's newest recoverable step (``latest_step``, the same on every rank),
    else ``IncompleteCheckpointError`` naming the step the tier holds."""
    newest, _ = tiers.latest_step()
    if newest != step:
        have = "holds no step" if newest is None else f"resumes from step {newest} (its newest recoverable step)"
        raise IncompleteCheckpointError(
            f"cannot resume from {where}: it names step {step} of the RAM tier ({tiers.fast.root} -> "
            f"{tiers.durable.root}), which {have}; step {step} was never committed on every host, or is no "
            f"longer kept (keep_fast, durable_every): resume from the checkpoint of step {newest}"
        )
    loaded = tiers.load_latest(state, **kwargs)
    if loaded != step:  # a copy failed its check between the two: the tier fell back
        raise IncompleteCheckpointError(
            f"cannot resume from {where}: step {step} failed verification while loading; the tier fell back "
            f"to step {loaded}: resume from the checkpoint of step {loaded}"
        )
