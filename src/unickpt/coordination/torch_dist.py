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
destroyed group). Group creation is marked the same way (``.../setup/<rank>``). While a rank waits in a
collective, or in the creation, it warns every ``CoordinationOptions.wait_warning_s`` (60 s)
naming the ranks whose count is behind (``coordination.waits``; read over a store connection of
its own). Every failure of torch.distributed inside unickpt's collectives (the collective, a
point-to-point transfer posted or waited for, the groups' creation) is raised as one of those two
errors, never as torch's own exception (chained as the cause).

Tree coordination (``coordination.tree``). When the parent group has at least
``CoordinationOptions.tree_min_world_size`` ranks, the first use also creates, for each channel,
the small gloo groups of a ``topology.TreeLayout`` (every rank of the parent creates every group,
in the same order; it keeps those it is a member of), after one all_gather of each rank's host
name and options on the foreground group (host names give the hosts, unless
``ranks_per_host`` is set; ranks whose options differ all raise ``RankDisagreementError``).
``make_coordinator`` then returns a ``TreeCoordinator`` whose guard is this coordinator: a tree
collective counts as one arrival, and its failures name the missing ranks the same way.

Commit barrier (``coordination.barrier``): ``store_scope`` hands it a connection of its own to the
job's store (``Store.clone``: a TCPStore connection serves one request at a time, and the barrier
waits on it), under keys of this coordinator's group.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from ..errors import CheckpointError, CollectiveError, CollectiveTimeoutError, RankDisagreementError
from . import _torch_private as private
from . import objects
from .store import StoreScope
from .topology import CoordinationOptions, TreeLayout, TreeShape, host_sizes
from .waits import OTHERS_NAME_THEM, WAITS, names_missing

__all__ = ["TorchDistCoordinator", "CheckpointGroups", "GroupLink", "TreeGroups"]

T = TypeVar("T")
CHANNELS = ("foreground", "background")
_TORCH_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's own default for gloo groups


class GroupLink:
    """The collectives of one group of the tree, rooted at its rank 0 (``tree.TreeLink``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.root = dist.get_global_rank(group, 0)
        self.members = dist.get_process_group_ranks(group)
        self._timeout: float | None = None

    def set_timeout(self, seconds: float) -> None:
        if seconds != self._timeout:
            private.set_group_timeout(self.group, timedelta(seconds=seconds))
            self._timeout = seconds

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return objects.gather(self.group, self.size, obj, self.root, self.rank == 0, self.members)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return objects.broadcast(self.group, self.size, obj, self.root, self.rank == 0)

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        return objects.scatter(
            self.group, self.size, objs if self.rank == 0 else None, self.root, self.rank == 0, self.members
        )


@dataclass(frozen=True, slots=True)
class TreeGroups:
    """A channel's tree: the layout, and this rank's group of each level it is a member of
    (groups of one member have none)."""

    layout: TreeLayout
    links: dict[int, GroupLink]


class Channel:
    """One of unickpt's gloo groups beside a parent group: its collective count (the same
    sequence on every rank), its current deadline and the arrival keys in the job's store; its
    tree groups, when the tree is used. Used by one thread at a time (foreground: the caller's;
    background: the save worker)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        name: str,
        key: str,
        store: Any,
        timeout: timedelta,
        warn_every: float | None = None,
    ) -> None:
        self.group, self.name, self.key, self.store = group, name, key, store
        self.timeout = timeout  # what the group's collectives use now
        self.warn_every = warn_every  # seconds between the warnings of a wait (None: none)
        self.seq = 0
        self.tree: TreeGroups | None = None
        self._barrier_store = _Clone(store)
        self._watch_store = _Clone(store)

    def barrier_store(self) -> Any:
        """A connection of its own to the job's store (None: none can be made)."""
        return self._barrier_store.get()

    def watch_store(self) -> Any:
        """The connection the wait warnings read arrivals over (``waits``: their own thread, never
        blocked behind a caller's request); None: none can be made."""
        return self._watch_store.get()

    def arrive(self, rank: int) -> int:
        """Count the next collective and record this rank's arrival at it (best effort)."""
        self.seq += 1
        _mark(self.store, f"{self.key}/{rank}", str(self.seq))
        return self.seq

    def apply_timeout(self, timeout: timedelta) -> None:
        if timeout != self.timeout:
            private.set_group_timeout(self.group, timeout)
            self.timeout = timeout

    def missing(self, seq: int, world_size: int, store: Any = None) -> list[int] | None:
        """Ranks (of this group) that have not arrived at collective ``seq``; None if unknown.
        ``store``: the connection to read over (default: the channel's)."""
        return _missing(store or self.store, self.key, world_size, lambda v: int(v) >= seq)


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
    independently). ``options``: when and how collectives run as a tree (module docstring)."""

    def __init__(self, options: CoordinationOptions | None = None) -> None:
        self.options = options or CoordinationOptions()
        self.warn_every = self.options.wait_warning_interval()  # read once, at the checkpointer's creation
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
        tag = f"unickpt/{getattr(parent, 'group_name', 'world')}"
        try:
            store = private.default_store()
        except Exception:
            store = None
        shape = self.options.resolved()
        first = timeout or _TORCH_DEFAULT_TIMEOUT
        size = 0
        out: dict[str, Channel] = {}
        t0 = time.monotonic()
        ticket = 0
        try:
            ranks = dist.get_process_group_ranks(parent)
            job = private.job_timeout(parent) or _TORCH_DEFAULT_TIMEOUT
            first = timeout or job
            rank, size = dist.get_rank(parent), dist.get_world_size(parent)
            _mark(store, f"{tag}/setup/{rank}", "1")
            watcher = _Clone(store)
            ticket = WAITS.watch(
                f"{label}: creating unickpt's process groups",
                self.warn_every,
                first.total_seconds(),
                _named(rank, lambda: _missing(watcher.get(), f"{tag}/setup", size, lambda v: True)),
                rank,
            )
            for ch in CHANNELS:
                group = dist.new_group(ranks=ranks, backend="gloo", timeout=first)
                out[ch] = Channel(group, ch, f"{tag}/{ch}", store, first, self.warn_every)
            if shape.uses_tree(size):
                layout = _layout(out["foreground"].group, size, shape, label)
                for ch in CHANNELS:
                    out[ch].tree = _tree_groups(ranks, rank, layout, first)
            for c in out.values():
                c.apply_timeout(job)  # later calls without their own timeout use the job's
        except CheckpointError:
            raise
        except Exception as e:
            missing = _missing(store, f"{tag}/setup", size, lambda v: True) if size else None
            raise _failure(label, "creating unickpt's process groups", e, time.monotonic() - t0, first, missing) from e
        finally:
            WAITS.done(ticket)
        return out


def _named(rank: int, missing: Callable[[], list[int] | None]) -> Callable[[], list[int] | str | None]:
    """What ``rank``'s wait warnings say about the missing ranks (``waits.NAMING_RANKS``)."""
    return missing if names_missing(rank) else (lambda: OTHERS_NAME_THEM)


class _Clone:
    """A connection of its own to ``store``, made on first use (None: none can be made)."""

    def __init__(self, store: Any) -> None:
        self.store, self._clone = store, None

    def get(self) -> Any:
        if self._clone is None and self.store is not None:
            try:
                self._clone = self.store.clone()
            except Exception:
                return None
        return self._clone


def _layout(group: dist.ProcessGroup, size: int, shape: TreeShape, label: str) -> TreeLayout:
    """The tree over the ranks of ``group``: one all_gather of (host name, options)."""
    mine = (socket.gethostname(), shape.fan_out, shape.ranks_per_host, shape.min_world_size)
    seen: list[Any] = [None] * size
    dist.all_gather_object(seen, mine, group=group)
    options = {r: repr(tuple(s[1:])) for r, s in enumerate(seen)}
    if len(set(options.values())) > 1:
        shown = "; ".join(f"rank {r}: {v}" for r, v in list(options.items())[:8])
        raise RankDisagreementError(
            f"{label}: the ranks disagree on the coordination options (fan_out, ranks_per_host, "
            f"tree_min_world_size; CoordinationOptions or $UNICKPT_TREE_*): {shown}",
            {"coordination options": options},
        )
    sizes = host_sizes(size, shape.ranks_per_host, [str(s[0]) for s in seen])
    return TreeLayout.build(sizes, shape.fan_out)


def _tree_groups(ranks: list[int], rank: int, layout: TreeLayout, timeout: timedelta) -> TreeGroups:
    """Every group of ``layout`` (of parent ranks ``ranks``), created by every rank in the same
    order; this rank keeps its own."""
    links: dict[int, GroupLink] = {}
    for level, groups in enumerate(layout.levels):
        for g in groups:
            if len(g.members) < 2:
                continue
            pg = dist.new_group(ranks=[ranks[m] for m in g.members], backend="gloo", timeout=timeout)
            if rank in g.members:
                links[level] = GroupLink(pg)
    return TreeGroups(layout, links)


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

    @property
    def channel(self) -> Channel:
        return self._channel

    def begin(self, op: str) -> tuple[str, int, float, int]:
        """Record this rank's arrival at the next collective (``op``), apply the deadline and
        start the wait warnings (``waits``); the token ``failure`` and ``end`` take
        (``tree.TreeGuard``)."""
        ch = self._channel
        seq = ch.arrive(self.rank)
        ticket = WAITS.watch(
            f"{self.label}: {self._what(op, seq)}",
            ch.warn_every,
            self.timeout.total_seconds(),
            _named(self.rank, lambda: ch.missing(seq, self.world_size, ch.watch_store())),
            self.rank,
        )
        token = (op, seq, time.monotonic(), ticket)
        try:
            ch.apply_timeout(self.timeout)
        except Exception as e:
            self.end(token)
            raise self.failure(token, e) from e
        return token

    def end(self, token: object) -> None:
        """Collective ``token`` returned or failed: no more warnings about it."""
        WAITS.done(cast("tuple[str, int, float, int]", token)[3])

    def _what(self, op: str, seq: int) -> str:
        ch = self._channel
        return f"{op} (collective #{seq} on its {ch.name} group{'s' if ch.tree is not None else ''})"

    def failure(self, token: object, e: BaseException, among: Sequence[int] | None = None) -> CheckpointError:
        """The error every rank that arrived raises for collective ``token`` failing with ``e``
        (``among``: the members of the tree group that failed, see ``_failure``)."""
        if isinstance(e, CheckpointError):
            return e
        op, seq, t0, _ = cast("tuple[str, int, float, int]", token)
        missing = self._channel.missing(seq, self.world_size)
        return _failure(self.label, self._what(op, seq), e, time.monotonic() - t0, self.timeout, missing, among)

    def _run(self, op: str, fn: Callable[[], T]) -> T:
        token = self.begin(op)
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as e:
            raise self.failure(token, e) from e
        finally:
            self.end(token)

    def store_scope(self) -> StoreScope | None:
        store = self._channel.barrier_store()
        if store is None:
            return None
        name = getattr(self.group, "group_name", None) or self._channel.key
        ch = self._channel
        limit = self.timeout.total_seconds()
        watch = ch.watch_store() if ch.warn_every is not None else None
        return StoreScope(store, f"unickpt/barrier/{name}", limit, self.label, ch.warn_every, watch)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._run("all_gather_object", lambda: objects.all_gather(self.group, self.world_size, obj))

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        ranks, ws = self._global_ranks, self.world_size
        return self._run(
            "gather_object", lambda: objects.gather(self.group, ws, obj, ranks[dst], self.rank == dst, ranks)
        )

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        ranks, ws = self._global_ranks, self.world_size
        return self._run(
            "broadcast_object", lambda: objects.broadcast(self.group, ws, obj, ranks[src], self.rank == src)
        )

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        ranks, ws, mine = self._global_ranks, self.world_size, self.rank == src
        return self._run(
            "scatter_object",
            lambda: objects.scatter(self.group, ws, objs if mine else None, ranks[src], mine, ranks),
        )

    def barrier(self) -> None:
        self._run("barrier", lambda: dist.barrier(group=self.group))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> _Work:
        what = f"send to rank {dst} (tag {tag})"
        # None only for a rank outside ``group``; this rank is always in its own group
        post = lambda: dist.isend(tensor, dst=self._global_ranks[dst], group=self.group, tag=tag)  # noqa: E731
        return _Work(self._post(what, post), self, what, dst)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> _Work:
        what = f"receive from rank {src} (tag {tag})"
        post = lambda: dist.irecv(tensor, src=self._global_ranks[src], group=self.group, tag=tag)  # noqa: E731
        return _Work(self._post(what, post), self, what, src)

    def _post(self, what: str, post: Callable[[], Any]) -> dist.Work:
        """Post a transfer; torch's failure to (a closed connection, a destroyed group) as
        ``CollectiveError`` like a failed ``wait``."""
        t0 = time.monotonic()
        try:
            return cast("dist.Work", post())
        except CheckpointError:
            raise
        except Exception as e:
            raise _failure(self.label, what, e, time.monotonic() - t0, self.timeout, None) from e


class _Work:
    """A point-to-point transfer whose failure surfaces as a ``CollectiveError``; waiting for it
    warns like a collective (``waits``), naming the peer."""

    def __init__(self, work: dist.Work, coord: TorchDistCoordinator, what: str, peer: int) -> None:
        self._work, self._coord, self._what, self._peer = work, coord, what, peer
        self._t0 = time.monotonic()

    def wait(self) -> bool:
        c = self._coord
        ticket = WAITS.watch(
            f"{c.label}: {self._what}", c.channel.warn_every, c.timeout.total_seconds(), lambda: [self._peer], c.rank
        )
        try:
            return bool(self._work.wait())
        except CheckpointError:
            raise
        except Exception as e:
            raise _failure(c.label, self._what, e, time.monotonic() - self._t0, c.timeout, None) from e
        finally:
            WAITS.done(ticket)


def _failure(
    label: str,
    what: str,
    e: BaseException,
    elapsed: float,
    timeout: timedelta,
    missing: list[int] | None,
    among: Sequence[int] | None = None,
) -> CheckpointError:
    """The error every rank that arrived raises for a failed collective (no rank-specific text:
    the underlying error is chained as the cause). ``among``: for a peer that died in one tree
    group (not a timeout), only that group's absent members are named: ranks of other groups
    may simply not have reached the collective yet when the failure was seen."""
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
    if missing is not None and among is not None:
        members = set(among)
        missing = [r for r in missing if r in members]
    who = f"; rank(s) {missing} had not arrived" if missing else ""
    return CollectiveError(
        f"{label}: {what} failed{who} (a peer process died or left: {type(e).__name__}: {e})",
        tuple(missing or ()),
        limit,
    )
