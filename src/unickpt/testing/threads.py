"""N ranks as threads of one process: a coordinator for unit tests and simulations of planning
and of the stage protocol, without gloo processes.

``run_threads(fn, world_size)`` starts ``world_size`` threads; thread ``r`` calls
``fn(ThreadCoordinator(exchange, r), *args)``; all share one ``ThreadExchange``. It returns the
results in rank order, or re-raises the failure of the lowest rank whose error is its own (not
the consequence of another rank leaving), with a note naming that rank.

``ThreadCoordinator`` implements the ``Coordinator`` protocol (``coordination.base``) with the
semantics of ``TorchDistCoordinator`` that unickpt relies on:
  * collectives are matched by their order on each rank (the n-th collective of every rank is
    the same one); ranks that call different collectives (or name a different ``src``/``dst``)
    at the same position all raise ``CollectiveError`` (torch would hang or exchange garbage);
  * copy semantics: torch pickles every object it exchanges, so no rank ever holds another
    rank's object. Here each object is deep-copied (``copy.deepcopy``) when a rank hands it
    over and again for every receiver, so a rank mutating what it sent or received cannot
    affect another. As in torch, ``broadcast_object`` returns the source rank's own object on
    the source rank. (Unlike torch, an object that deepcopy accepts but pickle refuses, e.g. a
    lambda, passes here.)
  * deadlines: each collective waits at most ``timeout`` seconds for every rank to arrive; then
    every rank that arrived raises ``CollectiveTimeoutError`` naming the ranks that did not
    (``missing_ranks``). A rank whose thread ended (returned or raised) before reaching a
    collective makes the ranks waiting in it raise ``CollectiveError`` at once, naming it, as a
    dead peer does under gloo.
  * ``isend``/``irecv`` move CPU tensors (the distributed load uses uint8 buffers): a send
    copies the tensor into the (src, dst, tag) mailbox at once (FIFO per key), ``wait()`` of a
    receive copies the next message into the given tensor (same dtype and size, else
    ``CollectiveError``).
  * ``store_scope()``: the exchange's ``MemoryStore`` (``exchange.store``), for the commit
    barrier (``coordination.barrier``).
``calls`` on each coordinator lists the collectives it made, in order (tests count round trips).

``run_threads(..., tree=layout)`` gives each rank a ``TreeCoordinator`` (``coordination.tree``)
instead: one exchange per group of ``layout`` (``topology.TreeLayout``), its flat coordinator on
the exchange of every rank (``coord.flat``).
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..coordination.store import MemoryStore, StoreScope
from ..coordination.topology import TreeLayout
from ..coordination.tree import TreeCoordinator
from ..errors import CollectiveError, CollectiveTimeoutError

__all__ = ["ThreadExchange", "ThreadCoordinator", "run_threads"]

T = TypeVar("T")


def _peer_left(message: str, ranks: tuple[int, ...]) -> CollectiveError:
    """The error of a collective or receive that failed because the threads of ``ranks`` ended
    before reaching it (marked, so ``run_threads`` reports the root cause instead)."""
    e = CollectiveError(message, ranks)
    e.peer_left = True  # type: ignore[attr-defined]
    return e


@dataclass
class _Round:
    """One collective (by position): what it is, and what each rank handed over."""

    op: str
    root: int | None  # src / dst where the collective has one
    values: dict[int, Any] = field(default_factory=dict)
    error: str = ""  # set when the ranks disagree on the collective
    readers: int = 0


class ThreadExchange:
    """What the thread-ranks of one fake job share: collective rounds and point-to-point mailboxes.

    ``timeout``: seconds each collective (and each receive) waits for the other ranks."""

    def __init__(self, world_size: int, timeout: float = 30.0, label: str = "threads") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout, self.label = world_size, timeout, label
        self._cond = threading.Condition()
        self._rounds: dict[int, _Round] = {}
        self._left: dict[int, tuple[int, str]] = {}  # rank -> (collectives it entered, how it left)
        self._mail: dict[tuple[int, int, int], deque[torch.Tensor]] = {}
        self.store = MemoryStore(timeout)

    def exchange(
        self, rank: int, seq: int, op: str, root: int | None, value: Any, timeout: float | None = None
    ) -> dict[int, Any]:
        """Hand ``value`` (already a private copy) to collective ``seq``; every rank's values
        once all arrived (waiting at most ``timeout``, default the exchange's). Raises
        ``CollectiveError`` / ``CollectiveTimeoutError``."""
        what = f"{op} (collective #{seq})"
        limit = self.timeout if timeout is None else timeout
        with self._cond:
            rnd = self._rounds.setdefault(seq, _Round(op, root))
            if (rnd.op, rnd.root) != (op, root) and not rnd.error:
                rnd.error = (
                    f"{self.label}: the ranks called different collectives at #{seq}: "
                    f"{_describe(rnd.op, rnd.root)} on rank(s) {sorted(rnd.values)}, "
                    f"{_describe(op, root)} on rank {rank}"
                )
            rnd.values[rank] = value
            self._cond.notify_all()
            deadline = time.monotonic() + limit
            while True:
                if rnd.error:
                    raise CollectiveError(rnd.error)
                if len(rnd.values) == self.world_size:
                    break
                gone = {q: left for q, left in self._left.items() if q not in rnd.values}
                if gone:
                    del rnd.values[rank]
                    who = "; ".join(f"rank {q} {how} after {n} collective(s)" for q, (n, how) in sorted(gone.items()))
                    raise _peer_left(f"{self.label}: {what} failed: {who} before reaching it", tuple(sorted(gone)))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    del rnd.values[rank]
                    missing = tuple(q for q in range(self.world_size) if q not in rnd.values and q != rank)
                    raise CollectiveTimeoutError(
                        f"{self.label}: {what} timed out after {limit:g}s: rank(s) {list(missing)} did not arrive",
                        missing,
                        limit,
                    )
                self._cond.wait(remaining)
            values = rnd.values
            rnd.readers += 1
            if rnd.readers == self.world_size:
                del self._rounds[seq]
            return values

    def leave(self, rank: int, entered: int, how: str) -> None:
        """Rank ``rank``'s thread ended after entering ``entered`` collectives (``how``:
        ``returned`` / ``raised <type>``): it will hand nothing more over."""
        with self._cond:
            self._left[rank] = (entered, how)
            self._cond.notify_all()

    def post(self, src: int, dst: int, tag: int, tensor: torch.Tensor) -> None:
        with self._cond:
            self._mail.setdefault((src, dst, tag), deque()).append(tensor.detach().clone())
            self._cond.notify_all()

    def take(self, src: int, dst: int, tag: int) -> torch.Tensor:
        """The next message from ``src`` to ``dst`` with ``tag`` (waits at most ``timeout``)."""
        key = (src, dst, tag)
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while not self._mail.get(key):
                if src in self._left:
                    raise _peer_left(
                        f"{self.label}: receive from rank {src} (tag {tag}) failed: rank {src} "
                        f"{self._left[src][1]} without sending it",
                        (src,),
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeoutError(
                        f"{self.label}: receive from rank {src} (tag {tag}) timed out after {self.timeout:g}s",
                        (src,),
                        self.timeout,
                    )
                self._cond.wait(remaining)
            return self._mail[key].popleft()


def _describe(op: str, root: int | None) -> str:
    return op if root is None else f"{op}(root {root})"


class _Done:
    """A completed transfer (a send: the message is already in the mailbox)."""

    def wait(self) -> bool:
        return True


class _Receive:
    def __init__(self, exchange: ThreadExchange, src: int, dst: int, tag: int, into: torch.Tensor) -> None:
        self._exchange, self._key, self._into = exchange, (src, dst, tag), into

    def wait(self) -> bool:
        src, _dst, tag = self._key
        msg = self._exchange.take(*self._key)
        if msg.dtype != self._into.dtype or msg.numel() != self._into.numel():
            raise CollectiveError(
                f"{self._exchange.label}: receive from rank {src} (tag {tag}): got {msg.numel()} x {msg.dtype}, "
                f"the buffer holds {self._into.numel()} x {self._into.dtype}"
            )
        self._into.view(-1).copy_(msg.view(-1))
        return True


class ThreadCoordinator:
    """Rank ``rank`` of the thread-ranks sharing ``exchange``; see the module docstring."""

    def __init__(self, exchange: ThreadExchange, rank: int) -> None:
        if not 0 <= rank < exchange.world_size:
            raise ValueError(f"rank {rank} is not a rank of world size {exchange.world_size}")
        self.exchange = exchange
        self.rank = rank
        self.world_size = exchange.world_size
        self.calls: list[str] = []
        self.timeout: float | None = None  # the deadline of its collectives (None: the exchange's)

    def _collective(self, op: str, root: int | None, value: Any) -> dict[int, Any]:
        if root is not None and not 0 <= root < self.world_size:
            raise ValueError(f"{op}: rank {root} is not a rank of world size {self.world_size}")
        self.calls.append(op)
        return self.exchange.exchange(self.rank, len(self.calls), op, root, value, self.timeout)

    @property
    def entered(self) -> int:
        """How many collectives this rank has entered."""
        return len(self.calls)

    def all_gather_object(self, obj: Any) -> list[Any]:
        values = self._collective("all_gather_object", None, copy.deepcopy(obj))
        return [copy.deepcopy(values[r]) for r in range(self.world_size)]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        values = self._collective("gather_object", dst, copy.deepcopy(obj))
        return [copy.deepcopy(values[r]) for r in range(self.world_size)] if self.rank == dst else None

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        values = self._collective("broadcast_object", src, copy.deepcopy(obj) if self.rank == src else None)
        return obj if self.rank == src else copy.deepcopy(values[src])

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        mine = None
        if self.rank == src:
            if objs is None or len(objs) != self.world_size:
                got = "None" if objs is None else f"{len(objs)} objects"
                raise ValueError(f"scatter_object: the source rank must pass {self.world_size} objects, got {got}")
            mine = copy.deepcopy(list(objs))
        values = self._collective("scatter_object", src, mine)
        return copy.deepcopy(values[src][self.rank])

    def barrier(self) -> None:
        self._collective("barrier", None, None)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> _Done:
        self.exchange.post(self.rank, dst, tag, tensor)
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> _Receive:
        return _Receive(self.exchange, src, self.rank, tag, tensor)

    def set_timeout(self, seconds: float) -> None:
        """The deadline of this rank's next collectives (a tree link's, ``tree.TreeLink``)."""
        self.timeout = seconds

    def store_scope(self) -> StoreScope:
        ex = self.exchange
        return StoreScope(ex.store, f"threads/{ex.label}", ex.timeout, ex.label)


def run_threads(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 30.0,
    limit: float | None = None,
    label: str = "threads",
    tree: TreeLayout | None = None,
) -> list[T]:
    """Run ``fn(coord, *args)`` on ``world_size`` thread-ranks; their results in rank order.

    ``timeout``: the deadline of each collective; ``limit``: of the whole run (default ten
    timeouts), after which ``TimeoutError`` names the ranks still running (their threads are
    daemons, left behind). A failure is re-raised as the exception object itself, with a note
    naming its rank: the lowest rank whose error is its own, else the lowest failing rank.
    ``tree``: ``coord`` is a ``TreeCoordinator`` over that layout (module docstring)."""
    if tree is not None and tree.world_size != world_size:
        raise ValueError(f"the tree has {tree.world_size} ranks, not {world_size}")
    exchange = ThreadExchange(world_size, timeout, label)
    groups: dict[tuple[int, int], ThreadExchange] = {}
    if tree is not None:
        for level, gs in enumerate(tree.levels):
            for g in gs:
                if len(g.members) > 1:
                    groups[(level, g.leader)] = ThreadExchange(len(g.members), timeout, f"{label}-L{level}-{g.leader}")
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def main(rank: int) -> None:
        coord = ThreadCoordinator(exchange, rank)
        links: dict[int, ThreadCoordinator] = {}
        how = "returned"
        try:
            if tree is None:
                results[rank] = fn(coord, *args)
            else:
                for level, g in tree.path(rank):
                    if len(g.members) > 1:
                        links[level] = ThreadCoordinator(groups[(level, g.leader)], g.members.index(rank))
                results[rank] = fn(TreeCoordinator(tree, rank, links, coord, timeout=timeout), *args)
        except BaseException as e:  # reported by the caller's thread below
            errors[rank] = e
            how = f"raised {type(e).__name__}"
        finally:
            exchange.leave(rank, coord.entered, how)
            for link in links.values():
                link.exchange.leave(link.rank, link.entered, how)

    threads = [
        threading.Thread(target=main, args=(r,), name=f"{label}-rank{r}", daemon=True) for r in range(world_size)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + (10 * timeout if limit is None else limit)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise TimeoutError(f"{label}: rank(s) {stuck} of {world_size} still running after the run's limit")
    if errors:
        own = [r for r, e in sorted(errors.items()) if not getattr(e, "peer_left", False)]
        rank = own[0] if own else min(errors)
        err = errors[rank]
        err.add_note(f"(raised on thread-rank {rank} of {world_size})")
        raise err
    return results
