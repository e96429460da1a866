"""The RAM tier with replicas: what ``TieredCheckpointManager`` does when ``replicas >= 1``.

``TieredCheckpointManager.__init__`` builds one ``RamTier`` on every rank (after its own fast
and durable managers; the fast one on ``shmnode://<name>``, the node-local form of
``shm://<name>``); then:

* ``after_save(step, handle)`` (every rank, right after the fast tier's ``save``) queues
  ``_replicate`` on the tier's single worker thread: it waits for the save, checks this host's
  folders of the step (``folders.step_folder_problem``: a link or a foreign folder planted since
  construction is a ``ConfigurationError`` on every rank, before any byte moves), then
  ``replicate.replicate_step``, then (every ``durable_every``-th step) ``durable.copy_to_durable``,
  then the RAM retention (``replicate.drop_old``);
* ``recover(durable_step)`` (every rank, from ``load_latest``) runs ``restore.recover`` on that
  same thread after every queued replication, and returns the decision and the report; with
  ``feed=True`` (the first pass) it is followed by ``start_feed(decision)`` (every rank: the
  ``feed.Feed`` the load reads through; a holder's agent queues ``feed.serve``), the load, then
  ``finish_feed(feed, loaded)`` (every rank: whether every rank loaded, the bytes fed) and, after
  a load that succeeded, ``rebuild_fed`` (every rank: ``restore.rebuild`` queued);
* ``latest(durable_step)`` (every rank, from ``TieredCheckpointManager.latest_step``) answers,
  on that thread after every queued replication, with the step ``load_latest`` would choose
  (``decide.choose`` over every host's inventory and the durable tier's newest step), the same
  on every rank, without moving or verifying a byte;
* ``flush(budget)`` (every rank, from ``TieredCheckpointManager``'s SIGTERM handler) copies the
  newest step committed everywhere to the durable tier, on the worker thread, within ``budget``;
* ``wait()`` raises the failures of queued replications (``AsyncSaveFailures``);
  ``close()`` waits, then stops the thread.

The worker thread is the only user of the tier's process group (``group.TierGroup``), but for
a feed's requests and replies: point-to-point messages with tags of their own, sent by the
load's reader threads of a host that lost its RAM while its holders' worker threads serve them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import AsyncSaveFailures, CheckpointError, ConfigurationError, IntegrityError
from ..folder.probe import read_committed
from ..manager import CheckpointManager
from ..storage import open_storage, register_storage
from ..storage.retry import unwrap
from ..storage.shm import ShmStorage
from .decide import choose
from .durable import copy_to_durable
from .feed import Feed, serve
from .folders import ram_folder_problem, step_folder_problem
from .group import TierGroup
from .inventory import RamLayout
from .replicate import drop_old, replicate_step
from .restore import Copies, RecoveryReport, ask_durable_early, rebuild, recover

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
        self._serving: Future[None] | None = None  # this host's ``serve`` of a feed (``start_feed``)
        self._lock = threading.Lock()

    def _stepdir(self, step: int) -> str:
        return self.fast.path_for(step)[len(self.fast.root) + 1 :]

    def after_save(self, step: int, handle: Any, nonfinite: list[str] | None = None) -> None:
        future = self._worker.submit(self._replicate, step, handle, nonfinite)
        with self._lock:
            self._pending.append((step, future))

    def _problem(self, stepdir: str) -> str | None:
        """What makes this host's RAM folders unsafe for ``stepdir`` (``folders.step_folder_problem``),
        or None: the step folder, and the replica folders of the hosts whose copies this host holds
        (and of rank 0's host, whose metadata every other host holds)."""
        tg = self.tg
        origins = {o for o, targets in tg.placement.items() if tg.host in targets}
        if tg.host != tg.rank_hosts[0]:
            origins.add(tg.rank_hosts[0])
        return step_folder_problem(self.fast.root, stepdir, origins)

    def _replicate(self, step: int, handle: Any, nonfinite: list[str] | None) -> None:
        """On the worker thread: wait for the local save, check this host's folders of the step
        (``_problem``: a link or a foreign folder planted since the tier was made), replicate and
        commit in RAM, copy to the durable tier when due (``durable.copy_to_durable``), then the
        RAM retention. Each phase ends in a collective that fails every rank alike
        (``TierGroup.fail_together``): no rank raises alone while its peers wait for it."""
        tg, stepdir = self.tg, self._stepdir(step)
        raw, error = None, None
        try:
            handle.wait()
            problem = self._problem(stepdir) if tg.is_agent else None
            if problem is not None:
                raise ConfigurationError(problem)
            if tg.rank == 0:
                raw = read_committed(open_storage(self.fast.path_for(step)))
                if raw is None:
                    raise IntegrityError(f"{self.fast.path_for(step)} has no metadata: its save did not commit")
        except Exception as e:
            error = e
        what = (
            f"step {step} was not replicated (no byte sent, nothing deleted; the previous committed step stays in use)"
        )
        tg.fail_together(error, what)
        check = functools.partial(self._problem, stepdir)
        bad = replicate_step(tg, self.layout, step, stepdir, raw, self.chunk, nonfinite, check)
        error = None
        if bad and tg.rank == 0:
            warnings.warn(
                f"step {step} holds NaN/Inf in {', '.join(bad)}: it is kept in RAM but never loaded by "
                "load_latest nor copied to the durable tier (check_finite=True)",
                stacklevel=2,
            )
        if step % self.durable_every == 0 and not bad:
            try:
                copy_to_durable(tg, self.layout, stepdir, step, self.durable, check)
                self._protect = None
            except CheckpointError as e:  # raised on every rank alike
                self._protect, error = stepdir, e  # kept in RAM until a newer durable copy commits
        failed = None
        try:
            if tg.is_agent:
                dropped = drop_old(self.layout, self.keep, self._protect)
                if tg.host == tg.rank_hosts[0]:  # the ordinary save's own files of rank 0's host
                    for _, rec in dropped:
                        gone = int(rec["step"])
                        self.fast._delete_checkpoint(gone, self.fast._scan().get(gone, []))
        except Exception as e:
            failed = e
        tg.fail_together(failed, f"the RAM retention after step {step} failed (step {step} is committed in RAM)")
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
        tg, newest, durable, error = self.tg, None, None, None
        try:
            if tg.is_agent:
                steps = [int(r["step"]) for r in self.layout.markers().values() if not r.get("nonfinite")]
                newest = max(steps, default=None)
            durable = self.durable.latest_step() if tg.rank == 0 else None
        except Exception as e:
            error = e
        gathered = tg.fail_together(error, "no step was flushed to the durable tier", [tg.is_agent, newest, durable])
        agents = [n for a, n, _ in gathered if a]
        if any(n is None for n in agents):
            return None
        target, done = min(agents), gathered[0][2]
        if done is not None and done >= target:
            return None
        stepdir = self._stepdir(target)
        copy_to_durable(tg, self.layout, stepdir, target, self.durable, functools.partial(self._problem, stepdir))
        self._protect = None
        return target

    def latest(self, durable_step: Callable[[], int | None]) -> tuple[int | None, str]:
        """``(step, "ram" | "durable")`` of the newest step of which every file has a copy in some
        host's RAM (CRC32Cs are checked when it is loaded), or the durable tier's newest when
        newer (RAM on a tie); ``(None, "none")`` when neither holds one. Every rank, same answer."""
        return self._worker.submit(self._latest, durable_step).result()

    def _latest(self, durable_step: Callable[[], int | None]) -> tuple[int | None, str]:
        tg, inv, answer, error = self.tg, None, None, None
        durable = ask_durable_early(durable_step) if tg.rank == 0 else None
        try:
            inv = self.layout.local_inventory() if tg.is_agent else None
        except Exception as e:
            error = e
        what = "the latest step of the RAM tier is unknown"
        gathered = tg.fail_together(error, what, [tg.host, inv])
        if tg.rank == 0:
            try:
                assert durable is not None
                decision = choose({h: i for h, i in gathered if i is not None}, durable.result())
                answer = [decision["step"], decision["source"]]
            except Exception as e:
                error = e
        step, source = tg.fail_together(error, what, answer)[0]
        return step, source

    def recover(
        self, durable_step: Callable[[], int | None], fetch: bool, load_verifies: bool = False, feed: bool = False
    ) -> tuple[dict[str, Any], RecoveryReport]:
        return self._worker.submit(recover, self.tg, self.layout, durable_step, fetch, load_verifies, feed).result()

    def start_feed(self, decision: dict[str, Any]) -> Feed:
        """After ``recover(feed=True)`` chose a RAM step (every rank): this rank's ``Feed`` (the
        storage wrapper its load reads through), and on a host that sends fed files, its agent's
        ``serve`` queued on the worker thread (``finish_feed`` runs after it)."""
        plan = decision.get("feed", {})
        feed = Feed(self.tg, decision, plan)
        sends = self.tg.is_agent and any(self.tg.host in files.values() for files in plan.values())
        self._serving = self._worker.submit(self._serve, decision, plan) if sends else None
        return feed

    def _serve(self, decision: dict[str, Any], plan: dict[str, dict[str, str]]) -> None:
        copies = Copies(self.layout)
        try:
            serve(self.tg, self.layout, decision, plan, copies)
        finally:
            copies.close()

    def finish_feed(self, feed: Feed, loaded: bool) -> tuple[bool, dict[str, int]]:
        """After the load (every rank, also when it failed or did not run): tell the holders this
        rank is done (``Feed.close``), then, once this host's ``serve`` has ended, whether every
        rank loaded and served without error, and the bytes every rank received from each
        sending host (summed). A failed ``serve`` counts as a failed load (the second pass)."""
        try:
            feed.close()
        except Exception:  # a holder gone: its own error (and the timeout of the gather) tells
            loaded = False
        serving, self._serving = self._serving, None

        def gather() -> list[Any]:
            ok = loaded and (serving is None or serving.exception() is None)
            return self.tg.all_gather([ok, feed.received])

        gathered = self._worker.submit(gather).result()
        by_host: Counter[str] = Counter()
        for _, received in gathered:
            by_host.update(received)
        return all(ok for ok, _ in gathered), dict(by_host)

    def rebuild_fed(self, step: int, decision: dict[str, Any]) -> None:
        """After a load that read files from their holders (every rank): ``restore.rebuild`` on
        the worker thread, in the background; its failure is raised by ``wait``."""
        future = self._worker.submit(rebuild, self.tg, self.layout, decision)
        with self._lock:
            self._pending.append((step, future))

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
