"""Peers as load sources: a host's ranks read what their host lacks straight from the holders' RAM.

A host whose RAM was lost (it holds no copy at all of some of its own ranks' files) used to get
those files written back into its tmpfs before the ordinary load read them there again
(``restore._fetch_rounds``): every byte crossed the group, was checked, written into fresh
tmpfs pages (allocated and zeroed 4 KiB at a time: the largest part of a recovery after a lost
host on the bench) and read once more by the load; and a restart in another layout got the
whole checkpoint copied into every host's RAM first. With a load that verifies every byte it
reads (``LoadOptions.verify_checksums``, the default) the first pass of ``load_latest``
instead *feeds* every data file a host holds no copy of:

1. ``restore.recover(feed=True)`` leaves such a file to this module; every rank computes the
   same ``plan_feed``: requesting host -> file -> the nearest holder (ring order from the
   requester, as ``restore._fetch_rounds`` picks), from the gathered outcomes;
2. each holder's agent runs ``serve`` on the tier's worker thread: it answers requests
   (``[reply tag, file, lo, hi]``, received from any rank) with a flag and the bytes, sent from a
   private mapping of its copy (``restore.Copies``), until every rank of every host it feeds
   has said it is done;
3. every rank of a requesting host loads through ``FedStorage``: its reads of a fed file (only
   the ranges its layout needs) become requests to the file's holder, received straight into
   the load's own memory (the destination tensor, or the load's temporary), then checked by the
   load like any read; then it tells each of its holders it is done (``Feed.close``, also after
   a failed load);
4. ``tier.RamTier.finish_feed`` gathers, after ``serve`` has ended, whether every rank loaded
   and the bytes each rank received from each holder (the recovery's records); a copy that
   fails the load's check sends ``load_latest`` to its second pass (which verifies every copy
   before use), as a copy here failing it does;
5. after a load that succeeded, ``restore.rebuild`` writes the host's own fed files (those it
   lost with its RAM) back into its RAM in the background (on the worker thread, every rank),
   so the step has its ``1 + replicas`` copies again.

The requests and replies are point-to-point messages of the tier's group with tags of their
own (``REQUEST_TAG``, one reply tag per request), so the load's reader threads can ask in
parallel; no collective runs on the group while ``serve`` runs (the worker thread is busy with
it on every holder, and requesters only send point to point).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from ..errors import MissingDataFileError
from ..storage.base import Storage
from .group import TierGroup
from .inventory import RamLayout
from .placement import ring_after

__all__ = ["Feed", "FedStorage", "plan_feed", "serve", "REQUEST_TAG"]

REQUEST_TAG = 7_340  # requests to a holder; replies use tags from _REPLY_TAGS
_REPLY_TAGS = 1 << 16  # a requester's reply tags cycle through [_REPLY_TAGS, 2 * _REPLY_TAGS)
_DONE = -1  # a request's file index saying "this rank asks nothing more"
_IN_FLIGHT = 8  # replies a holder has sent and not seen completed before it waits for the oldest


def plan_feed(tg: TierGroup, d: dict[str, Any], fed: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """Requesting host -> fed file -> the host that sends it: the nearest other host in ring order
    from the requester (sorted hosts) that holds a copy (``d["holders"]``). ``fed``: each
    requesting host's files no copy on it holds. The same on every rank."""
    ring = list(tg.hosts)
    plan: dict[str, dict[str, str]] = {}
    for requester, names in sorted(fed.items()):
        if not names:
            continue
        nearest = ring_after(ring, requester)
        for name in sorted(names):
            holders = {h[0] for h in d["holders"][name]}
            plan.setdefault(requester, {})[name] = next(h for h in nearest if h in holders)
    return plan


def _askers(tg: TierGroup, plan: dict[str, dict[str, str]], holder: str) -> int:
    """How many ranks will say "done" to ``holder``'s agent: every rank of a host it feeds."""
    return sum(1 for h in tg.rank_hosts if holder in plan.get(h, {}).values())


def serve(tg: TierGroup, layout: RamLayout, d: dict[str, Any], plan: dict[str, dict[str, str]],
          copies: Any) -> None:  # fmt: skip
    """Step 2 on a holder's agent (the worker thread): answer requests until every rank that may
    ask has said it is done. A request for a file this host does not feed to the
    asker's host, a range outside the file, or a copy missing or shorter than recorded is
    answered with flag 0 and no bytes (the asker's load then fails and ``load_latest`` falls to
    its second pass). ``copies``: a ``restore.Copies`` of this host's RAM (closed by the caller
    after this returns: every send has completed by then)."""
    names = sorted(d["files"])
    left = _askers(tg, plan, tg.host)
    sending: deque[tuple[list[Any], torch.Tensor]] = deque()  # each reply's works and its flag (alive until sent)
    request = torch.empty(4, dtype=torch.int64)
    try:
        while left:
            asker = dist.recv(request, src=None, group=tg.group, tag=REQUEST_TAG)
            tag, f, lo, hi = (int(v) for v in request.tolist())
            if f == _DONE:
                left -= 1
                continue
            view = None
            if 0 <= f < len(names) and plan.get(tg.rank_hosts[asker], {}).get(names[f]) == tg.host:
                name = names[f]
                size = int(d["files"][name][0])
                mine = next(h for h in d["holders"][name] if h[0] == tg.host)
                if 0 <= lo <= hi <= size and hi > lo:
                    whole = copies.mapped(layout.path_of({"name": name, "where": mine[1], "origin": mine[2]},
                                                         d["stepdir"]), 0, size, size)  # fmt: skip
                    view = None if whole is None else whole[lo:hi]
            flag = torch.tensor([int(view is not None)], dtype=torch.int64)
            works = [dist.isend(flag, asker, group=tg.group, tag=tag)]
            if view is not None:
                works.append(dist.isend(view, asker, group=tg.group, tag=tag))
            sending.append((works, flag))
            if len(sending) > _IN_FLIGHT:
                _settle(sending.popleft()[0])
    finally:
        while sending:
            _settle(sending.popleft()[0])


def _settle(works: list[Any]) -> None:
    for w in works:
        w.wait()


class Feed:
    """One rank's side of a feed (step 3), made on every rank after ``recover``: ``wrap`` gives
    the storage the load reads through (``FedStorage`` on a requesting host, the RAM folder
    itself elsewhere); ``close`` (once, after the load, also after a failed one or none) tells
    every holder of this host's fed files that this rank asks nothing more; ``received`` is
    then the bytes from each holder. ``fetch`` is called by many reader threads at once."""

    def __init__(self, tg: TierGroup, d: dict[str, Any], plan: dict[str, dict[str, str]]) -> None:
        self.tg = tg
        self.sources = plan.get(tg.host, {})  # fed file -> the host that sends it
        self._index = {n: i for i, n in enumerate(sorted(d["files"]))}
        self.sizes = {n: int(d["files"][n][0]) for n in self.sources}
        self._lock = threading.Lock()
        self._tags = itertools.cycle(range(_REPLY_TAGS, 2 * _REPLY_TAGS))
        self.received: dict[str, int] = {}
        self._closed = False

    def wrap(self, inner: Storage) -> Storage:
        return FedStorage(inner, self) if self.sources else inner

    def fetch(self, name: str, offset: int, view: memoryview) -> None:
        """Bytes ``[offset, offset + len(view))`` of the fed file ``name`` from its holder, into
        ``view``; ``MissingDataFileError`` when the holder has no readable copy of them."""
        n = len(view)
        if n == 0:
            return
        holder = self.sources[name]
        at, group = self.tg.agents[holder], self.tg.group
        with self._lock:
            tag = next(self._tags)
        request = torch.tensor([tag, self._index[name], offset, offset + n], dtype=torch.int64)
        dist.send(request, at, group=group, tag=REQUEST_TAG)
        flag = torch.zeros(1, dtype=torch.int64)
        dist.recv(flag, at, group=group, tag=tag)
        if not flag.item():
            raise MissingDataFileError(
                f"{name}: host {holder} has no readable copy of bytes [{offset}, {offset + n}) for host "
                f"{self.tg.host}, whose RAM lost the file (the second pass of load_latest verifies every copy)"
            )
        dist.recv(torch.frombuffer(view, dtype=torch.uint8), at, group=group, tag=tag)
        with self._lock:
            self.received[holder] = self.received.get(holder, 0) + n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        done = torch.tensor([0, _DONE, 0, 0], dtype=torch.int64)
        for holder in sorted(set(self.sources.values())):
            dist.send(done, self.tg.agents[holder], group=self.tg.group, tag=REQUEST_TAG)


class FedStorage:
    """The load's storage on a requesting host: ``inner`` (the step's folder in this host's RAM)
    but for the fed files, whose sizes are the recorded ones and whose reads are requests to
    their holders (``Feed.fetch``), received into the reader's own buffer."""

    def __init__(self, inner: Storage, feed: Feed) -> None:
        self.inner, self.feed = inner, feed
        self.url = inner.url
        # every read of a fed file is a round trip: the load's reader threads each ask for a whole
        # piece, several in flight, instead of one reader per file asking for its reads in turn
        self.capabilities = dataclasses.replace(inner.capabilities, reads_ahead=False)

    def __getattr__(self, attr: str) -> Any:  # everything else is the RAM folder's
        return getattr(self.inner, attr)

    def size(self, name: str) -> int | None:
        return self.feed.sizes[name] if name in self.feed.sources else self.inner.size(name)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        if name in self.feed.sources:
            self.feed.fetch(name, offset, memoryview(out).cast("B"))
        else:
            self.inner.read_into(name, offset, out)

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        if name in self.feed.sources:
            self.feed.fetch(name, offset, memoryview(out).cast("B"))
        else:
            self.inner.read_into_cached(name, offset, out)
