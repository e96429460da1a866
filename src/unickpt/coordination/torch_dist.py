"""Coordinator over ``torch.distributed``.

Checkpoint traffic runs on two gloo process groups of its own, created once per parent group by
every rank at its first save/load: ``foreground`` for what the calling thread does (planning,
load), ``background`` for what the async save worker does (commit). So background saves never
interleave collectives with the training job's NCCL/gloo collectives nor with a foreground
save/load planning at the same time, and object collectives work on CPU whatever the training
backend is. Objects exchanged here are unickpt's own plan records and error reports between
live ranks of one job, never data read from a checkpoint.

Deadlines and missing ranks. unickpt's groups are created with the job's timeout (the one given
to ``init_process_group``; ``SaveOptions.timeout`` / ``LoadOptions.timeout`` override it per
call, as the deadline of each collective). Before every collective a rank records in the job's
store how many collectives it has entered on that group (``unickpt/<parent>/<group>/<rank>``:
one key per rank, overwritten). When a collective fails, the ranks whose count is behind are
the ones that did not arrive: every rank that did arrive raises the same
``CollectiveTimeoutError`` naming them (``CollectiveError`` for other failures: a dead peer, a
destroyed group). Group creation is marked the same way (``.../setup/<rank>``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from ..errors import CheckpointError, CollectiveError, CollectiveTimeoutError
from . import _torch_private as private

__all__ = ["TorchDistCoordinator", "CheckpointGroups"]

T = TypeVar("T")
CHANNELS = ("foreground", "background")
_TORCH_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's own default for gloo groups


class Channel:
    """One of unickpt's gloo groups beside a parent group: its collective count (the same
    sequence on every rank), its current deadline and the arrival keys in the job's store.
    Used by one thread at a time (foreground: the caller's; background: the save worker)."""

    def __init__(self, group: dist.ProcessGroup, name: str, key: str, store: Any, timeout: timedelta) -> None:
        self.group, self.name, self.key, self.store = group, name, key, store
        self.timeout = timeout  # what the group's collectives use now
        self.seq = 0

    def arrive(self, rank: int) -> int:
        """Count the next collective and record this rank's arrival at it (best effort)."""
        self.seq += 1
        _mark(self.store, f"{self.key}/{rank}", str(self.seq))
        return self.seq

    def apply_timeout(self, timeout: timedelta) -> None:
        if timeout != self.timeout:
            private.set_group_timeout(self.group, timeout)
            self.timeout = timeout

    def missing(self, seq: int, world_size: int) -> list[int] | None:
        """Ranks (of this group) that have not arrived at collective ``seq``; None if unknown."""
        return _missing(self.store, self.key, world_size, lambda v: int(v) >= seq)


def _mark(store: Any, key: str, value: str) -> None:
    if store is None:
        return
    try:
        store.set(key, value)
    except Exception:  # the store is gone (its host died): the collective will tell
        pass


def _missing(store: Any, key: str, world_size: int, arrived: Callable[[str], bool]) -> list[int] | None:
    if store is None:
        return None
    out = []
    try:
        for r in range(world_size):
            k = f"{key}/{r}"
            if not store.check([k]) or not arrived(store.get(k).decode()):
                out.append(r)
    except Exception:
        return None
    return out


class CheckpointGroups:
    """unickpt's process groups per parent group, created on first use. Each ``Checkpointer``
    owns one (so two checkpointers never share a communicator: their background commits run
    independently)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: dict[int, tuple[dist.ProcessGroup, dict[str, Channel]]] = {}

    def channel(
        self, parent: dist.ProcessGroup | None, name: str, timeout: timedelta | None = None, label: str = ""
    ) -> Channel:
        """The channel ``name`` beside ``parent`` (default: the world). The first call creates
        the groups of every channel, in a fixed order: all ranks of ``parent`` must make it from
        their main thread (save/load do). ``timeout`` bounds that creation (default: the job's)."""
        parent = parent or dist.group.WORLD
        assert parent is not None
        with self._lock:
            found = self._sets.get(id(parent))
            if found is None or found[0] is not parent or not private.group_is_live(found[1][name].group):
                found = (parent, self._create(parent, timeout, label))
                self._sets[id(parent)] = found
            return found[1][name]

    def _create(self, parent: dist.ProcessGroup, timeout: timedelta | None, label: str) -> dict[str, Channel]:
        ranks = dist.get_process_group_ranks(parent)
        tag = f"unickpt/{getattr(parent, 'group_name', 'world')}"
        try:
            store = private.default_store()
        except Exception:
            store = None
        job = private.job_timeout(parent) or _TORCH_DEFAULT_TIMEOUT
        first = timeout or job
        rank, size = dist.get_rank(parent), dist.get_world_size(parent)
        _mark(store, f"{tag}/setup/{rank}", "1")
        out = {}
        t0 = time.monotonic()
        try:
            for ch in CHANNELS:
                group = dist.new_group(ranks=ranks, backend="gloo", timeout=first)
                out[ch] = Channel(group, ch, f"{tag}/{ch}", store, first)
        except Exception as e:
            missing = _missing(store, f"{tag}/setup", size, lambda v: True)
            raise _failure(label, "creating unickpt's process groups", e, time.monotonic() - t0, first, missing) from e
        for c in out.values():
            c.apply_timeout(job)  # later calls without their own timeout use the job's
        return out


class TorchDistCoordinator:
    """Collectives of one save/load (``label`` names it in errors) on one channel.

    ``timeout`` (seconds): the deadline of each collective, default the job's timeout."""

    def __init__(
        self,
        groups: CheckpointGroups,
        group: dist.ProcessGroup | None = None,
        channel: str = "foreground",
        *,
        timeout: float | None = None,
        label: str = "unickpt",
    ) -> None:
        deadline = timedelta(seconds=timeout) if timeout is not None else None
        self._channel = groups.channel(group, channel, deadline, label)
        self.group = self._channel.group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._global_ranks = dist.get_process_group_ranks(self.group)
        self.label = label
        job = private.job_timeout(group) or _TORCH_DEFAULT_TIMEOUT
        self.timeout = deadline or job

    def _run(self, op: str, fn: Callable[[], T]) -> T:
        ch = self._channel
        seq = ch.arrive(self.rank)
        t0 = time.monotonic()
        try:
            ch.apply_timeout(self.timeout)
            return fn()
        except CheckpointError:
            raise
        except Exception as e:
            missing = ch.missing(seq, self.world_size)
            what = f"{op} (collective #{seq} on its {ch.name} group)"
            raise _failure(self.label, what, e, time.monotonic() - t0, self.timeout, missing) from e

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._run("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        self._run("gather_object", lambda: dist.gather_object(obj, out, dst=self._global_ranks[dst], group=self.group))
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._run(
            "broadcast_object", lambda: dist.broadcast_object_list(box, src=self._global_ranks[src], group=self.group)
        )
        return box[0]

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        out: list[Any] = [None]
        self._run(
            "scatter_object",
            lambda: dist.scatter_object_list(
                out, objs if self.rank == src else None, src=self._global_ranks[src], group=self.group
            ),
        )
        return out[0]

    def barrier(self) -> None:
        self._run("barrier", lambda: dist.barrier(group=self.group))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> _Work:
        # None only for a rank outside ``group``; this rank is always in its own group
        work = cast("dist.Work", dist.isend(tensor, dst=self._global_ranks[dst], group=self.group, tag=tag))
        return _Work(work, self, f"send to rank {dst}")

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> _Work:
        work = cast("dist.Work", dist.irecv(tensor, src=self._global_ranks[src], group=self.group, tag=tag))
        return _Work(work, self, f"receive from rank {src}")


class _Work:
    """A point-to-point transfer whose failure surfaces as a ``CollectiveError``."""

    def __init__(self, work: dist.Work, coord: TorchDistCoordinator, what: str) -> None:
        self._work, self._coord, self._what = work, coord, what
        self._t0 = time.monotonic()

    def wait(self) -> bool:
        try:
            return bool(self._work.wait())
        except CheckpointError:
            raise
        except Exception as e:
            c = self._coord
            raise _failure(c.label, self._what, e, time.monotonic() - self._t0, c.timeout, None) from e


def _failure(
    label: str, what: str, e: BaseException, elapsed: float, timeout: timedelta, missing: list[int] | None
) -> CheckpointError:
    """The error every rank that arrived raises for a failed collective (no rank-specific text:
    the underlying error is chained as the cause)."""
    limit = timeout.total_seconds()
    if not (dist.is_available() and dist.is_initialized()):
        return CollectiveError(
            f"{label}: {what} failed because torch.distributed.destroy_process_group() was called while "
            "it ran (it also destroys unickpt's process groups); wait for saves first: handle.wait(), "
            "unickpt.wait_all() or CheckpointManager.wait(), then destroy_process_group()",
            tuple(missing or ()),
        )
    text = str(e).lower()
    if "timed out" in text or "timeout" in text or elapsed >= 0.95 * limit:
        if missing:
            who = f"rank(s) {missing} did not arrive"
        elif missing is None:
            who = "the ranks that did not arrive are unknown (the job's store cannot be read)"
        else:
            who = "every rank arrived, but some left before it completed (failed or timed out earlier)"
        return CollectiveTimeoutError(
            f"{label}: {what} timed out after {limit:g}s: {who}. Every rank must make the same unickpt "
            "calls (save, load, CheckpointManager) in the same order; a rank that skipped one, or is "
            "still busy before it, blocks the others. Raise the limit with SaveOptions(timeout=...) / "
            "LoadOptions(timeout=...) or init_process_group(timeout=...).",
            tuple(missing or ()),
            limit,
        )
    who = f"; rank(s) {missing} had not arrived" if missing else ""
    return CollectiveError(
        f"{label}: {what} failed{who} (a peer process died or left: {type(e).__name__}: {e})",
        tuple(missing or ()),
        limit,
    )
