"""The RAM tier's own gloo process group, its hosts, and the JSON collectives it runs.

``TierGroup.create(options_digest, replicas)`` is called by ``TieredCheckpointManager.__init__``
(``replicas >= 1``) on every rank, in the same order as every other group creation: it makes a
gloo group over all ranks (``dist.new_group``), then runs the tier's first collective on the
calling (main) thread: every rank's host id (``UNICKPT_HOST_ID``, else ``socket.gethostname()``),
failure domain (``UNICKPT_FAILURE_DOMAIN``, else none), the digest of the tier's options and
what is wrong with its host's RAM folders (``tier.ram_folder_problem``, None when nothing).
A RAM folder that is not the user's own, ranks disagreeing on the options, or
``replicas >= hosts`` raise ``ConfigurationError`` on every rank (all of them see the same
gathered list). From then on the group is used by *one thread
only*, the tier's worker thread (``replicate`` and ``restore``), never beside another collective
of it. A host's *agent* is its lowest rank: it does the host's file work and transfers; other
ranks take part in the collectives with nothing to offer.

A rank whose file work fails never raises alone (its peers would wait in the next collective
until the timeout): each phase catches its rank's error and ends with ``fail_together``, a
gather after which every rank raises the same error, or none.

The collectives move JSON (and raw bytes) in uint8 tensors: nothing is pickled.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..coordination import objects
from ..errors import (
    CheckpointError,
    ConcurrencyError,
    ConfigurationError,
    CoordinationError,
    IntegrityError,
    InternalError,
    StateMismatchError,
    StorageError,
)
from .placement import ring_placement

__all__ = ["TierGroup", "host_id", "family_of", "FAMILY_ORDER", "HOST_ENV", "DOMAIN_ENV"]

HOST_ENV = "UNICKPT_HOST_ID"
DOMAIN_ENV = "UNICKPT_FAILURE_DOMAIN"


def host_id() -> str:
    """This process's host: ``UNICKPT_HOST_ID`` when set, else the machine's host name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


@dataclass(frozen=True)
class TierGroup:
    group: Any  # the gloo ProcessGroup (None in a one-process job)
    rank: int
    world_size: int
    host: str
    hosts: tuple[str, ...]  # sorted distinct host ids: the ring
    rank_hosts: tuple[str, ...]  # host of every rank
    agents: dict[str, int]  # host -> its agent (lowest rank)
    placement: dict[str, tuple[str, ...]]

    @property
    def is_agent(self) -> bool:
        return self.agents[self.host] == self.rank

    @classmethod
    def create(cls, digest: str, replicas: int, timeout: float, problem: str | None = None) -> TierGroup:
        me, domain = host_id(), os.environ.get(DOMAIN_ENV, "")
        if dist.is_available() and dist.is_initialized():
            rank, ws = dist.get_rank(), dist.get_world_size()
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        else:
            rank, ws, group = 0, 1, None
        gathered = all_gather_json(group, ws, [me, domain, digest, problem])
        problems = sorted({f"host {g[0]}: {g[3]}" for g in gathered if g[3]})
        if problems:
            raise ConfigurationError(
                f"the RAM tier refuses {len(problems)} host(s) whose RAM folder is not the user's own (nothing "
                f"was read, written or deleted there): {'; '.join(problems[:3])}"
            )
        digests = {g[2] for g in gathered}
        if len(digests) > 1:
            differing = sorted({f"rank {r} (host {g[0]})" for r, g in enumerate(gathered) if g[2] != gathered[0][2]})
            raise ConfigurationError(
                "the ranks' TieredCheckpointManager options differ (replicas, durable_every, keep_fast, chunk "
                f"size, roots): {', '.join(differing)} disagree with rank 0; construct it with the same "
                "arguments on every rank"
            )
        rank_hosts = tuple(g[0] for g in gathered)
        domains: dict[str, str] = {}
        for h, d, *_ in gathered:
            if domains.setdefault(h, d) != d:
                raise ConfigurationError(
                    f"host {h} has ranks with different {DOMAIN_ENV} values ({domains[h]!r}, {d!r}): "
                    "give every rank of one host the same failure domain"
                )
        placement = ring_placement(rank_hosts, replicas, domains)  # ConfigurationError on every rank
        agents: dict[str, int] = {}
        for r, h in enumerate(rank_hosts):
            agents.setdefault(h, r)
        return cls(group, rank, ws, me, tuple(sorted(set(rank_hosts))), rank_hosts, agents, placement)

    def all_gather(self, obj: Any) -> list[Any]:
        return all_gather_json(self.group, self.world_size, obj)

    def fail_together(self, error: BaseException | None, what: str, obj: Any = None) -> list[Any]:
        """A collective (every rank, at the end of one phase): ``error`` is what this rank's part
        of the phase raised (None: it succeeded). When any rank failed, every rank raises the same
        error: of the family (``family_of``) first in ``FAMILY_ORDER`` among the failures (the
        cause before what it caused elsewhere, e.g. an unsafe folder before the CRC mismatch of
        the stream it cut), its message ``what`` and each failing rank's host, rank and message
        (the first three); the failing rank's own error is its ``__cause__``. Otherwise every
        rank's ``obj`` (JSON), in rank order: the phase's own gather, in the same collective."""
        mine = None if error is None else [family_of(error).__name__, _describe(error)]
        gathered = self.all_gather([obj, mine])
        failed = [(r, g[1]) for r, g in enumerate(gathered) if g[1] is not None]
        if not failed:
            return [g[0] for g in gathered]
        names = [f.__name__ for f in FAMILY_ORDER]
        family = FAMILY_ORDER[min(names.index(f[0]) for _, f in failed)]
        lines = [f"host {self.rank_hosts[r]} (rank {r}): {f[1]}" for r, f in failed[:3]]
        more = f"; and {len(failed) - 3} more rank(s)" if len(failed) > 3 else ""
        raise family(f"{what}: {'; '.join(lines)}{more}") from error

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        if self.group is None:
            assert data is not None
            return data
        assert self.rank != src or data is not None
        global_src = dist.get_global_rank(self.group, src)
        return bytes(objects.broadcast(self.group, self.world_size, data, global_src, self.rank == src, objects.RAW))

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor, dst=dst, group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        dist.recv(tensor, src=src, group=self.group)

    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        """``dist.isend`` in the tier's group: its work (``wait()``); ``tensor`` must live until then."""
        return dist.isend(tensor, dst=dst, group=self.group)

    def irecv(self, tensor: torch.Tensor, src: int) -> Any:
        return dist.irecv(tensor, src=src, group=self.group)


# the order in which ``fail_together`` picks the family of a phase's failures
FAMILY_ORDER: tuple[type[CheckpointError], ...] = (
    ConfigurationError,
    StorageError,
    IntegrityError,
    ConcurrencyError,
    StateMismatchError,
    CoordinationError,
    InternalError,
)


def family_of(error: BaseException) -> type[CheckpointError]:
    """The family of ``FAMILY_ORDER`` an error belongs to: its own; an ``OSError`` that is none of
    unickpt's is a ``StorageError``; another ``CheckpointError`` (e.g. ``NotACheckpointError``: a
    step's file gone from RAM) an ``IntegrityError``; anything else an ``InternalError``."""
    for family in FAMILY_ORDER:
        if isinstance(error, family):
            return family
    if isinstance(error, CheckpointError):
        return IntegrityError
    return StorageError if isinstance(error, OSError) else InternalError


def _describe(error: BaseException) -> str:
    """The error's message, with its class name unless it is a family itself."""
    return str(error) if type(error) in FAMILY_ORDER else f"{type(error).__name__}: {error}"


def all_gather_json(group: Any, world_size: int, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON values only), in rank order (one collective when every rank's
    fits its slot: ``coordination.objects``)."""
    if group is None:
        return [json.loads(json.dumps(obj, separators=(",", ":")))]
    return objects.all_gather(group, world_size, obj, objects.JSON)
