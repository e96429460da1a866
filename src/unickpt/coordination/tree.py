"""The ``Coordinator`` protocol as a tree of small groups (``topology.TreeLayout``).

Up: each rank hands its value to its host's leader, leaders hand their hosts' lists to their
group's leader, and so on up to rank 0. Down: rank 0 hands the result (a broadcast, every rank's
list of an all_gather, each rank's part of a scatter) to the leaders below it, which hand it on
to their groups. No rank talks to more than its own groups: one group of its host and, for a
leader, one group of ``fan_out`` leaders per level it leads.

    gather_object(dst=0)     up                  rank 0 gets every rank's value, in rank order
    all_gather_object        up, then down       every rank gets every value, in rank order
    broadcast_object(src=0)  down
    scatter_object(src=0)    down                each leader forwards the slices of its subtree
    barrier                  up (no data), then down
Another ``dst``/``src`` than rank 0, and ``isend``/``irecv``, use the flat coordinator. Values are
pickled once by the rank that has them and unpickled once by the rank that receives them; the
leaders between pass bytes. Results equal those of the flat collectives (tests/coordination).

Deadlines. A group of level ``k`` waits at most ``timeout + k * margin`` in the up phase, and
every group ``timeout + depth * margin`` in the down phase (``margin``: a twentieth of the
timeout, between 1 and 60 seconds), so a leader that waited the full ``timeout`` for a rank of its
host still hands its failure up before the levels above give up on it, and rank 0's answer still
reaches ranks that wait for it. A tree collective fails within ``timeout + depth * margin``.

Failures travel the same way. A rank whose part of a collective failed (a peer died, a deadline
passed) turns the error into a record (``_Failed``: type, message, the ranks that did not arrive)
and hands it on instead of its value: up to rank 0, which then sends the first record of rank
order down in place of the result, so that every rank it reaches raises the same
``CollectiveTimeoutError`` / ``CollectiveError``. Groups where the failure happened are not used
again within that collective (their members meet their own deadline instead).

``guard`` (``TreeGuard``): what each collective records before it starts (and as it ends: its
wait warnings stop) and how a local failure becomes a ``CheckpointError``;
``TorchDistCoordinator`` is one (arrival counts in the job's store name the missing ranks),
``PlainGuard`` (thread-ranks) keeps the links' own errors.
"""

from __future__ import annotations

import builtins
import io
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..errors import CheckpointError, CollectiveError, CollectiveTimeoutError
from .base import Coordinator
from .store import StoreScope
from .topology import TreeGroup, TreeLayout

__all__ = ["TreeCoordinator", "TreeLink", "TreeGuard", "PlainGuard"]

T = TypeVar("T")


class TreeLink(Protocol):
    """The collectives of one group of the tree, rooted at its leader (its rank 0)."""

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any: ...

    def set_timeout(self, seconds: float) -> None:
        """The deadline of the next collectives on this group."""
        ...


class TreeGuard(Protocol):
    def begin(self, op: str) -> object:
        """Called on every rank as collective ``op`` starts; returns what ``failure`` needs."""
        ...

    def failure(self, token: object, error: BaseException, among: Sequence[int] | None = None) -> CheckpointError:
        """The error this rank reports for ``error`` raised by one of its groups (``among``: that
        group's members; a peer that died is one of them, ranks elsewhere merely not there yet)."""
        ...

    def end(self, token: object) -> None:
        """Called on every rank as the collective of ``token`` returns or fails."""
        ...


class PlainGuard:
    """Keeps the ``CheckpointError`` the links raise; wraps anything else in ``CollectiveError``."""

    def begin(self, op: str) -> object:
        return op

    def failure(self, token: object, error: BaseException, among: Sequence[int] | None = None) -> CheckpointError:
        if isinstance(error, CheckpointError):
            return error
        return CollectiveError(f"{token}: {type(error).__name__}: {error}")

    def end(self, token: object) -> None:
        pass


@dataclass(frozen=True, slots=True)
class _Failed:
    """A failure handed along the tree in place of a value."""

    timeout: bool
    message: str
    missing: tuple[int, ...]
    timeout_s: float | None

    @classmethod
    def of(cls, e: CheckpointError) -> _Failed:
        missing = tuple(getattr(e, "missing_ranks", ()))
        return cls(isinstance(e, TimeoutError), str(e), missing, getattr(e, "timeout_s", None))

    def error(self) -> CollectiveError:
        cls = CollectiveTimeoutError if self.timeout else CollectiveError
        return cls(self.message, self.missing, self.timeout_s)


class _Call:
    """One collective on this rank: the guard's token, the groups that failed in it, and this
    rank's own first error (the cause of what it raises)."""

    def __init__(self, token: object) -> None:
        self.token = token
        self.broken: set[int] = set()
        self.cause: CheckpointError | None = None


class TreeCoordinator:
    """Rank ``rank`` of ``layout``; ``links``: level -> a coordinator on this rank's group of that
    level (its rank 0: the group's leader), for each group of more than one member; ``flat``: the
    coordinator of every rank (other roots, point-to-point, the store); ``timeout``: seconds,
    the base of the groups' deadlines (None: the links keep theirs)."""

    def __init__(
        self,
        layout: TreeLayout,
        rank: int,
        links: Mapping[int, TreeLink],
        flat: Coordinator,
        guard: TreeGuard | None = None,
        timeout: float | None = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.world_size = layout.world_size
        self._path = layout.path(rank)
        self._links = dict(links)
        self.flat = flat
        self._guard = guard or PlainGuard()
        for level, group in self._path:
            if len(group.members) > 1 and level not in self._links:
                raise ValueError(f"rank {rank} has no link for its group of level {level}: {group.members}")
        self._top = self._path[-1]
        self._root = rank == 0
        # the levels this rank leads a group of more than one member, top first (the down phase)
        self._leads = [(lv, g) for lv, g in reversed(self._path) if g.leader == rank and len(g.members) > 1]
        self.timeout = timeout
        self.margin = 0.0 if timeout is None else min(max(1.0, timeout / 20), 60.0)

    # ------------------------------------------------------------------ the Coordinator protocol

    def all_gather_object(self, obj: Any) -> list[Any]:
        def run(call: _Call) -> Any:
            return self._broadcast_down(call, self._up(call, [_dumps(obj)]))

        return [_loads(b) for b in self._run("all_gather_object", run)]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if dst != 0:
            return self.flat.gather_object(obj, dst)
        got = self._run("gather_object", lambda call: self._up(call, [_dumps(obj)]))
        return [_loads(b) for b in got] if self._root else None

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if src != 0:
            return self.flat.broadcast_object(obj, src)

        def run(call: _Call) -> Any:
            return self._broadcast_down(call, _dumps(obj) if self._root else None)

        got = self._run("broadcast_object", run)
        return obj if self._root else _loads(got)

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        if src != 0:
            return self.flat.scatter_object(objs, src)
        if self._root and (objs is None or len(objs) != self.world_size):
            got = "None" if objs is None else f"{len(objs)} objects"
            raise ValueError(f"scatter_object: the source rank must pass {self.world_size} objects, got {got}")

        def run(call: _Call) -> Any:
            return self._scatter_down(call, [_dumps(o) for o in objs or ()] if self._root else None)

        (mine,) = self._run("scatter_object", run)
        return _loads(mine)

    def barrier(self) -> None:
        self._run("barrier", lambda call: self._broadcast_down(call, self._up(call, [])))

    def isend(self, tensor: Any, dst: int, tag: int) -> Any:
        return self.flat.isend(tensor, dst, tag)

    def irecv(self, tensor: Any, src: int, tag: int) -> Any:
        return self.flat.irecv(tensor, src, tag)

    def store_scope(self) -> StoreScope | None:
        return self.flat.store_scope()

    # ------------------------------------------------------------------ phases

    def _run(self, op: str, fn: Callable[[_Call], Any]) -> Any:
        call = _Call(self._guard.begin(f"{op} over the tree"))
        try:
            out = fn(call)
        except CheckpointError:
            raise
        except Exception as e:  # not from a link (those are caught where they happen)
            raise self._guard.failure(call.token, e) from e
        finally:
            self._guard.end(call.token)
        if isinstance(out, _Failed):
            raise out.error() from call.cause
        return out

    def _link(self, level: int, down: bool) -> TreeLink:
        """This rank's group of ``level``, its deadline set for the phase."""
        link = self._links[level]
        if self.timeout is not None:
            link.set_timeout(self.timeout + self.margin * (len(self.layout.levels) if down else level))
        return link

    def _fail(self, call: _Call, level: int, e: BaseException) -> _Failed:
        group = dict(self._path)[level]
        err = self._guard.failure(call.token, e, group.members)
        call.broken.add(level)
        if call.cause is None:
            call.cause = err
        return _Failed.of(err)

    def _up(self, call: _Call, acc: list[bytes]) -> Any:
        """Hand ``acc`` (this rank's values, in rank order) up the tree; rank 0 returns every
        rank's values (or the first failure), the others None once their leader has them (or
        their own failure, when handing them up failed)."""
        value: list[bytes] | _Failed = acc
        for level, group in self._path:
            if len(group.members) == 1:
                continue
            link = self._link(level, down=False)
            if group.leader != self.rank:
                try:
                    link.gather_object(value, dst=0)
                except Exception as e:
                    return self._fail(call, level, e)
                return None
            try:
                got = link.gather_object(value, dst=0)
            except Exception as e:
                value = self._fail(call, level, e)
                continue
            value = _merge(got or [])
        return value

    def _broadcast_down(self, call: _Call, value: Any) -> Any:
        """Rank 0 sends ``value`` down; the others receive it from their top group's leader (or
        keep their failure from the up phase) and send on what they got to the groups they lead."""
        if not self._root:
            value = self._receive(call, value, lambda link: link.broadcast_object(None, src=0))
        for level, _group in self._leads:
            if level in call.broken:
                continue
            try:
                self._link(level, down=True).broadcast_object(value, src=0)
            except Exception as e:
                value = self._fail(call, level, e)
        return value

    def _scatter_down(self, call: _Call, items: list[bytes] | None) -> Any:
        """Each rank ends with ``[its item]``: rank 0 slices ``items`` for the groups it leads;
        each leader receives the slice of its subtree and slices it on."""
        value: list[bytes] | _Failed | None = items
        if not self._root:
            value = self._receive(call, None, lambda link: link.scatter_object(None, src=0))
        for level, group in self._leads:
            if level in call.broken:
                continue
            parts: list[Any] = [value] * len(group.members) if isinstance(value, _Failed) else _slices(value, group)
            try:
                self._link(level, down=True).scatter_object(parts, src=0)
            except Exception as e:
                value = self._fail(call, level, e)
                continue
            value = parts[0]
        return value

    def _receive(self, call: _Call, failed: Any, op: Callable[[TreeLink], Any]) -> Any:
        """What this (non-root) rank receives from its top group's leader; its own failure when
        that group already failed in this collective."""
        level, _group = self._top
        if level in call.broken:
            return failed
        try:
            return op(self._link(level, down=True))
        except Exception as e:
            return self._fail(call, level, e)


def _merge(got: list[Any]) -> list[bytes] | _Failed:
    """Members' lists, concatenated in member order (= rank order); the first failure if any."""
    out: list[bytes] = []
    for part in got:
        if isinstance(part, _Failed):
            return part
        out.extend(part)
    return out


def _slices(value: Any, group: TreeGroup) -> list[Any]:
    """``value`` (the items of ``group``'s ranks) cut into each member's slice."""
    start = group.leader
    return [value[a - start : b - start] for a, b in (group.span(i) for i in range(len(group.members)))]


def _dumps(obj: Any) -> bytes:
    # unickpt's plan records and error reports between live ranks of one job (what
    # torch.distributed's object collectives pickle too), never data read from a checkpoint
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class _OwnRecordsOnly(pickle.Unpickler):
    """Rebuilds only what unickpt's collectives exchange: builtin values and unickpt's own
    records (plans, outcomes, errors). Any other class is refused, so a value that is not
    unickpt's never turns into code run on the receiving rank."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _BUILTINS:
            return getattr(builtins, name)
        if module == "unickpt" or module.startswith("unickpt."):
            obj: object = sys.modules.get(module)
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, type):
                return obj
        raise pickle.UnpicklingError(f"a unickpt collective does not carry {module}.{name}")


_BUILTINS = frozenset(
    {
        "set",
        "frozenset",
        "tuple",
        "list",
        "dict",
        "bytes",
        "bytearray",
        "int",
        "float",
        "complex",
        "str",
        "slice",
        "range",
    }
)


def _loads(data: bytes) -> Any:
    return _OwnRecordsOnly(io.BytesIO(data)).load()
