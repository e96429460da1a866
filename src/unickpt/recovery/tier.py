"""The RAM tier with replicas: what ``TieredCheckpointManager`` does when ``replicas >= 1``.

``TieredCheckpointManager.__init__`` builds one ``RamTier`` on every rank (after its own fast
and durable managers; the fast one on ``shmnode://<name>``, the node-local form of
``shm://<name>``); then:

* ``after_save(step, handle)`` (every rank, right after the fast tier's ``save``) queues
  ``_replicate`` on the tier's single worker thread: it waits for the save, then
  ``replicate.replicate_step``, then (every ``durable_every``-th step) ``durable.copy_to_durable``,
  then the RAM retention (``replicate.drop_old``);
* ``recover(durable_step)`` (every rank, from ``load_latest``) runs ``restore.recover`` on that
  same thread after every queued replication, and returns the decision and the report;
* ``latest(durable_step)`` (every rank, from ``TieredCheckpointManager.latest_step``) answers,
  on that thread after every queued replication, with the step ``load_latest`` would choose
  (``decide.choose`` over every host's inventory and the durable tier's newest step), the same
  on every rank, without moving or verifying a byte;
* ``flush(budget)`` (every rank, from ``TieredCheckpointManager``'s SIGTERM handler) copies the
  newest step committed everywhere to the durable tier, on the worker thread, within ``budget``;
* ``wait()`` raises the failures of queued replications (``AsyncSaveFailures``);
  ``close()`` waits, then stops the thread.

The worker thread is the only user of the tier's process group (``group.TierGroup``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import AsyncSaveFailures, CheckpointError, ConfigurationError, StorageError
from ..folder.probe import read_committed
from ..manager import CheckpointManager
from ..storage import open_storage, register_storage
from ..storage.retry import unwrap
from ..storage.shm import ShmStorage, folder_flaw, private_base, shm_base
from .decide import choose
from .durable import copy_to_durable
from .group import TierGroup
from .inventory import RamLayout
from .replicate import drop_old, replicate_step
from .restore import RecoveryReport, recover

__all__ = ["RamTier", "NodeShmStorage", "RamStepsManager", "node_root", "ram_folder_problem", "tier_group"]


class NodeShmStorage(ShmStorage):
    """``shmnode://name``: ``shm://name`` whose data files live on the host of the rank that wrote
    them (the save's commit does not look for other hosts' files; ``replicate`` checks every
    chunk of every file before the step counts as committed in RAM)."""

    capabilities = dataclasses.replace(ShmStorage.capabilities, node_local=True)

    def __init__(self, path: str, options: Any = None) -> None:
        super().__init__(path, options)
        self.url = "shmnode://" + self.url[len("shm://") :]


register_storage("shmnode", NodeShmStorage, replace=True)


class RamStepsManager(CheckpointManager):
    """The fast tier's manager with replicas: a host's step folder holds only its own ranks'
    files, so the manager's own retention (which would call it damaged) never runs; the RAM
    tier's retention is ``replicate``'s (``keep_fast`` committed steps per host)."""

    def apply_retention(self, plan: Any = None) -> list[int]:
        return []


def node_root(fast_root: str) -> str:
    if not fast_root.startswith("shm://"):
        raise ConfigurationError(f"replicas >= 1 needs a node-local RAM fast tier, shm://<name>, not {fast_root!r}")
    return "shmnode://" + fast_root[len("shm://") :]


def ram_folder_problem(node_url: str) -> str | None:
    """What makes this host's RAM folders of ``shmnode://<name>`` unsafe, or None: the shm base
    (``storage.shm.private_base``: this user's, mode 0700, no link), then every existing folder
    from it down to the root, and the root's own folders (``recovery``, ``replicas``,
    ``replicas/<host>``, ``step_N``): a link, no folder, another user's, or writable by the
    group or others. Whoever controls one could plant, swap or delete the copies the job
    recovers from. Called on every rank before the tier's first collective (``tier_group``)."""
    base = shm_base()
    try:
        private_base(base)
    except StorageError as e:  # UnsafePathError, or a base that cannot be created
        return e.strerror or str(e)
    path, folders = base, []
    for part in node_url[len("shmnode://") :].strip("/").split("/"):
        path = os.path.join(path, part)
        folders.append(path)
    root = path
    folders += [os.path.join(root, "recovery"), os.path.join(root, "replicas")]
    for folder in folders:
        problem = _folder_problem(folder)
        if problem is not None:
            return problem
    for sub, prefix in ((root, "step_"), (os.path.join(root, "replicas"), "")):
        if os.path.isdir(sub):  # checked above: a real folder of ours, not a link
            for name in sorted(os.listdir(sub)):
                problem = _folder_problem(os.path.join(sub, name), listed=True) if name.startswith(prefix) else None
                if problem is not None:
                    return problem
    return None


def _folder_problem(path: str, listed: bool = False) -> str | None:
    """Why the folder ``path`` is unsafe (``ram_folder_problem``), or None; a file found by
    listing (``listed``) is some other file (the tier never reads it), not a folder out of place."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if listed and stat.S_ISREG(st.st_mode):
        return None
    what = folder_flaw(st, 0o022)
    if what is None:
        return None
    return (
        f"{path} {what}; the RAM tier keeps this host's checkpoints and other hosts' replicas there, so it must "
        "be a folder of yours that no one else can write: fix its owner and mode (chmod 700) or remove it"
    )


def tier_group(node_url: str, options: dict[str, Any], replicas: int, timeout: float) -> TierGroup:
    """The tier's process group (``TierGroup.create``), made before anything touches the RAM
    folders: a host whose folders are unsafe (``ram_folder_problem``) fails every rank."""
    digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]
    return TierGroup.create(digest, replicas, timeout, ram_folder_problem(node_url))


class RamTier:
    def __init__(self, tg: TierGroup, fast: Any, durable: Any, durable_every: int, keep: int,
                 chunk: int) -> None:  # fmt: skip
        self.tg = tg
        self.fast = fast
        self.layout = RamLayout(unwrap(open_storage(fast.root)).root)
        self.keep, self.chunk = keep, chunk
        self.durable, self.durable_every = durable, durable_every
        self._protect: str | None = None  # a step due on the durable tier whose copy did not commit
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="unickpt-ram-tier")
        self._pending: list[tuple[int, Future[Any]]] = []
        self._lock = threading.Lock()

    def _stepdir(self, step: int) -> str:
        return self.fast.path_for(step)[len(self.fast.root) + 1 :]

    def after_save(self, step: int, handle: Any, nonfinite: list[str] | None = None) -> None:
        future = self._worker.submit(self._replicate, step, handle, nonfinite)
        with self._lock:
            self._pending.append((step, future))

    def _replicate(self, step: int, handle: Any, nonfinite: list[str] | None) -> None:
        """On the worker thread: wait for the local save, replicate and commit in RAM, copy to the
        durable tier when due (``durable.copy_to_durable``), then the RAM retention."""
        handle.wait()
        stepdir = self._stepdir(step)
        raw = read_committed(open_storage(self.fast.path_for(step))) if self.tg.rank == 0 else None
        bad = replicate_step(self.tg, self.layout, step, stepdir, raw, self.chunk, nonfinite)
        error: BaseException | None = None
        if bad and self.tg.rank == 0:
            warnings.warn(
                f"step {step} holds NaN/Inf in {', '.join(bad)}: it is kept in RAM but never loaded by "
                "load_latest nor copied to the durable tier (check_finite=True)",
                stacklevel=2,
            )
        if step % self.durable_every == 0 and not bad:
            try:
                copy_to_durable(self.tg, self.layout, stepdir, step, self.durable)
                self._protect = None
            except CheckpointError as e:
                self._protect, error = stepdir, e  # kept in RAM until a newer durable copy commits
        if self.tg.is_agent:
            dropped = drop_old(self.layout, self.keep, self._protect)
            if self.tg.host == self.tg.rank_hosts[0]:  # the ordinary save's own files of rank 0's host
                for _, rec in dropped:
                    gone = int(rec["step"])
                    self.fast._delete_checkpoint(gone, self.fast._scan().get(gone, []))
        if error is not None:
            raise error

    def flush(self, budget: float) -> int | None:
        """Copy the newest step committed in every host's RAM to the durable tier unless it is
        there already (every rank, e.g. from the SIGTERM handler; the copy runs on the worker
        thread after the queued replications); waits at most ``budget`` seconds. The step
        copied, or None."""
        future = self._worker.submit(self._flush)
        return future.result(timeout=budget)

    def _flush(self) -> int | None:
        newest = None
        if self.tg.is_agent:
            steps = [int(r["step"]) for r in self.layout.markers().values() if not r.get("nonfinite")]
            newest = max(steps, default=None)
        durable = self.durable.latest_step() if self.tg.rank == 0 else None
        gathered = self.tg.all_gather([self.tg.is_agent, newest, durable])
        agents = [n for a, n, _ in gathered if a]
        if any(n is None for n in agents):
            return None
        target, done = min(agents), gathered[0][2]
        if done is not None and done >= target:
            return None
        copy_to_durable(self.tg, self.layout, self._stepdir(target), target, self.durable)
        self._protect = None
        return target

    def latest(self, durable_step: Callable[[], int | None]) -> tuple[int | None, str]:
        """``(step, "ram" | "durable")`` of the newest step of which every file has a copy in some
        host's RAM (CRC32Cs are checked when it is loaded), or the durable tier's newest when
        newer (RAM on a tie); ``(None, "none")`` when neither holds one. Every rank, same answer."""
        return self._worker.submit(self._latest, durable_step).result()

    def _latest(self, durable_step: Callable[[], int | None]) -> tuple[int | None, str]:
        inv = self.layout.local_inventory() if self.tg.is_agent else None
        gathered = self.tg.all_gather([self.tg.host, inv])
        answer = None
        if self.tg.rank == 0:
            decision = choose({h: i for h, i in gathered if i is not None}, durable_step())
            answer = [decision["step"], decision["source"]]
        step, source = self.tg.all_gather(answer)[0]
        return step, source

    def recover(
        self, durable_step: Callable[[], int | None], fetch: bool, load_verifies: bool = False
    ) -> tuple[dict[str, Any], RecoveryReport]:
        return self._worker.submit(recover, self.tg, self.layout, durable_step, fetch, load_verifies).result()

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank's ``ok`` is true (a collective of the tier group, on its thread)."""
        return all(self._worker.submit(self.tg.all_gather, ok).result())

    def wait(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        failures = []
        for step, future in pending:
            error = future.exception()
            if error is not None:
                failures.append((self.fast.path_for(step), error))
        if failures:
            raise AsyncSaveFailures(failures, " to the other hosts' RAM")

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._worker.shutdown(wait=True)
