"""Materialise a chosen RAM step as a complete checkpoint folder in every host's own RAM.

``recover`` runs on the tier's worker thread of every rank (``tier.RamTier.load_latest`` waits
for it), after every queued replication:

1. each host's agent reads its inventory (``RamLayout.local_inventory``); all ranks gather them;
   rank 0 adds the durable tier's newest step and decides (``decide.choose``); the decision is
   broadcast (JSON);
2. for a RAM step, each agent builds ``step_N/`` of its own RAM root file by file (the metadata
   last): a primary here whose every chunk verifies stays; a replica here whose every chunk
   verifies is hard-linked as ``<name>.unickpt-part`` (no byte copied); otherwise the file is
   assembled in ``<name>.unickpt-part`` from this host's copies chunk by chunk, each chunk's
   CRC32C checked. In the first pass of ``load_latest`` (``fetch=False``), when the load that
   follows verifies every chunk it reads (``LoadOptions.verify_checksums``, the default:
   ``feed``), it reads no data file here at all: every primary is taken as it is and every
   replica here is hard-linked, so each byte is read and checked once, by the load (a copy
   failing there sends ``load_latest`` to the second pass); a data file no copy here holds is
   left to the load, which reads the ranges it needs from a holder (``recovery.feed``), and
   ``rebuild`` writes the host's own such files here afterwards. Without the load's check it
   completes only the metadata and the host's own ranks' files, verifying them here;
3. the chunks still missing are fetched in rounds: all ranks gather every agent's requests (file,
   chunk, hosts that already failed it); each request goes to the nearest holder (ring order from
   the requester) that has not failed it; in one global order the holder's agent reads the chunk
   and sends it with a flag (unreadable: no copy), up to two chunks in flight each way
   (``_exchange``); the requester checks its CRC32C on arrival and writes it, or notes the
   failed copy for the next round;
4. a gather of every agent's outcome: complete everywhere -> each ``.unickpt-part`` is renamed
   (data first, the metadata last) and the agent's commit marker gains the materialised files;
   a chunk no copy could supply -> the parts are removed and the step is excluded: back to 1.

Then every rank loads ``step_N`` from its own host's RAM with the ordinary ``load`` (its planner
reshards to the new layout), the holders feeding what the host lacks. A restart whose hosts
kept their RAM reads nothing but the primaries and moves no byte between hosts; a host whose
RAM was lost reads its own files from their holders; a resharded restart reads the ranges it
needs of the files its host lacks. When the load fails on some rank (a copy that failed its
check, a range a holder could not serve; without the load's check: another layout, or values
one rank saved for all) the second pass (``fetch=True``) verifies and completes every file on
every host. Cost: every host then holds the whole chosen checkpoint once more than its
primaries and replicas (replicas here are hard links, not copies).
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import IntegrityError
from ..format.checksums import crc32c
from ..format.records import METADATA_FILE
from ..storage.local_files import pwrite_all, truncate
from .decide import choose
from .feed import plan_feed
from .group import TierGroup
from .inventory import RamLayout
from .placement import ring_after

__all__ = ["recover", "rebuild", "rebuilds", "RecoveryReport", "ask_durable_early"]


@dataclass(frozen=True)
class RecoveryReport:
    """What a ``load_latest`` with replicas loaded, from where (every host's counts, summed)."""

    step: int | None
    tier: str  # "ram", "durable" or "none"
    bytes_by_source: dict[str, int] = field(default_factory=dict)  # "local", "peer", "durable"
    peer_bytes_by_host: dict[str, int] = field(default_factory=dict)  # sending host -> bytes
    failed_copies: tuple[str, ...] = ()  # "host:file#chunk (why)"
    skipped_steps: tuple[str, ...] = ()  # RAM steps passed over, and why
    fed_bytes: int = 0  # of the "peer" bytes, those the load read straight from other hosts' RAM (``feed``)


def recover(
    tg: TierGroup,
    layout: RamLayout,
    durable_step: Callable[[], int | None],
    fetch: bool = True,
    load_verifies: bool = False,
    feed: bool = False,
) -> tuple[dict[str, Any], RecoveryReport]:
    """Steps 1-4 (module docstring) until a RAM step is materialised on every host, or the
    decision is the durable tier or nothing. ``durable_step()`` is called on rank 0 only, once,
    beside the inventories' gathering (``ask_durable_early``).

    ``fetch=False`` (the first try of ``load_latest``, the same-layout pass): each host completes
    only what a restart at the same layout reads, the metadata and the files its own ranks wrote
    (their origin is this host), from its own copies; one it holds no copy of at all (its RAM
    was lost) comes from the peers; one whose copy here fails its CRC32C is left to the
    ``fetch=True`` pass (which verifies and names every failing copy). With ``load_verifies``
    the copies here are not read at all (``_materialise``): the load that follows checks them,
    and a failure there is what sends ``load_latest`` to that pass. ``feed`` (with
    ``load_verifies``, ``fetch=False``): every copy here is placed (not only the host's own
    files), and a data file no copy here holds is not fetched: the decision's ``"feed"`` says
    which holder feeds it to the load (``recovery.feed``). A job whose hosts all kept their
    RAM moves no byte between hosts. The decision says ``"complete"`` (every host has every
    file), ``"metadata_everywhere"`` and ``"feed"``."""
    excluded: list[list[str]] = []
    failed_all: list[str] = []
    skipped: list[str] = []
    durable = ask_durable_early(durable_step) if tg.rank == 0 else None
    while True:
        inv, error = None, None
        if tg.is_agent:
            try:
                inv = layout.local_inventory()
            except Exception as e:  # every rank raises it (fail_together), none waits alone
                error = e
        unlisted = "no recovery decision: a host's RAM tier could not be listed"
        gathered = tg.fail_together(error, unlisted, [tg.host, inv])
        inventories = {h: i for h, i in gathered if i is not None}
        decision = None
        if tg.rank == 0:
            try:
                assert durable is not None
                decision = choose(inventories, durable.result(), excluded)
            except Exception as e:
                error = e
        decision = tg.fail_together(error, "no recovery decision", decision)[0]
        skipped += [f"step {s} (save {sid}): " + (n if n.startswith("non-finite") else f"no copy of {n}")
                    for s, sid, n in decision.pop("incomplete")]  # fmt: skip
        if decision["source"] != "ram":
            return decision, _report(tg, decision, {}, {}, failed_all, skipped)
        feeds = feed and load_verifies and not fetch
        local, peers, failed, lacking, fed, error = _materialise(tg, layout, decision, fetch, load_verifies, feeds)
        what = f"step {decision['step']} could not be completed in the RAM tier"
        outcomes = tg.fail_together(
            error, what, [not lacking, local, peers, failed, METADATA_FILE not in lacking, tg.host, fed]
        )
        decision["feed"] = plan_feed(tg, decision, {o[5]: o[6] for o in outcomes if o[6]})
        failed_all += [f for o in outcomes for f in o[3]]
        decision["complete"] = all(o[0] for o in outcomes)
        decision["metadata_everywhere"] = all(o[4] for o in outcomes)
        done = decision["complete"] or not fetch
        try:
            if tg.is_agent:
                _discard(layout, decision, lacking if done else decision["files"])
                if done:
                    _finish(layout, decision, tg.host)
        except Exception as e:
            error = e
        tg.fail_together(error, f"step {decision['step']}'s files could not be put in place in the RAM tier")
        if done:
            totals = {"local": sum(o[1] for o in outcomes), "peer": sum(sum(o[2].values()) for o in outcomes)}
            by_host: dict[str, int] = {}
            for o in outcomes:
                for h, n in o[2].items():
                    by_host[h] = by_host.get(h, 0) + n
            return decision, _report(tg, decision, totals, by_host, failed_all, skipped)
        skipped.append(f"step {decision['step']} (save {decision['save_id']}): a chunk has no verified copy")
        excluded.append([decision["stepdir"], decision["save_id"]])


def rebuild(tg: TierGroup, layout: RamLayout, d: dict[str, Any]) -> None:
    """After a load that read files from their holders (``feed``; every rank, on the tier's
    worker thread, in the background of the training that follows): write those of a host's
    own files (it wrote them: it lost them with its RAM) back into its RAM, fetched as in step
    3 (each chunk's CRC32C checked on arrival; a copy that fails it is asked of the next
    holder), then renamed into place and recorded in the host's marker, so that the step again
    has ``1 + replicas`` copies of them (another host's files the load read are not kept: their
    copies are where placement put them). A chunk no copy
    supplies, or a write that fails, leaves the step as it was (the parts removed) and is one
    error on every rank (``RamTier.wait`` raises it)."""
    mine = _own_fed(d, tg.host) if tg.is_agent else []
    need: dict[str, dict[int, list[str]]] = {}
    parts: dict[str, int] = {}
    peers: dict[str, int] = {}
    failed: list[str] = []
    errors: list[Exception] = []
    copies = Copies(layout)
    try:
        try:
            for name in mine:
                size, crcs = d["files"][name]
                parts[name] = fd = layout.create(layout.primary(d["stepdir"], name) + ".unickpt-part")
                truncate(fd, size)
                need[name] = {i: [tg.host] for i in range(len(crcs))}
        except Exception as e:
            errors.append(e)
        _fetch_rounds(tg, layout, d, need, parts, peers, failed, copies, errors)
    finally:
        copies.close()
        for fd in parts.values():
            os.close(fd)
    error = errors[0] if errors else None
    if error is None and need:
        error = IntegrityError(f"no verified copy of {', '.join(sorted(need))} ({'; '.join(failed[:3])})")
    try:
        if mine:
            if error is None:
                _finish(layout, d, tg.host)
            else:
                _discard(layout, d, mine)
    except Exception as e:
        error = error or e
    tg.fail_together(
        error, f"the files of step {d['step']} the load read from other hosts were not written back into their "
        "host's RAM (the load is complete; until a newer step commits, they have one copy fewer)",
    )  # fmt: skip


def rebuilds(d: dict[str, Any]) -> bool:
    """Whether ``rebuild`` has a file to write back on some host (the same answer on every rank)."""
    return any(_own_fed(d, host) for host in d.get("feed", {}))


def _own_fed(d: dict[str, Any], host: str) -> list[str]:
    """The files fed to ``host``'s load that ``host`` wrote (it lost them with its RAM), sorted."""
    return sorted(n for n in d.get("feed", {}).get(host, {}) if d["holders"][n][0][2] == host)


def ask_durable_early(durable_step: Callable[[], int | None]) -> Future[int | None]:
    """``durable_step()`` running on a thread of its own from the start of ``recover`` and of
    ``tier.RamTier.latest`` (rank 0), so that the durable tier's answer (round trips to S3 or a
    NAS: ~0.05 s of a 0.2 s recovery on the bench's S3) overlaps the listing and gathering of
    every host's inventory; its error, if any, is raised by ``result()`` where the decision is
    made. The durable tier does not change during a recovery, so one answer serves every round
    of ``recover``'s loop."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="unickpt-durable-latest")
    try:
        return pool.submit(durable_step)
    finally:
        pool.shutdown(wait=False)  # the thread ends with the call


def _report(tg: TierGroup, d: dict[str, Any], totals: dict[str, int], by_host: dict[str, int],
            failed: list[str], skipped: list[str]) -> RecoveryReport:  # fmt: skip
    return RecoveryReport(d["step"], d["source"], totals, by_host, tuple(failed), tuple(skipped))


def _path_on(layout: RamLayout, d: dict[str, Any], name: str, where: str, origin: str) -> str:
    entry = {"name": name, "where": where, "origin": origin}
    return layout.path_of(entry, d["stepdir"])


def _read_into(fd: int, at: int, view: memoryview) -> bool:
    """The bytes at offset ``at`` of the copy open at ``fd`` into ``view`` (its exact length);
    False when the copy is short."""
    n, got = len(view), 0
    while got < n:
        k = os.preadv(fd, [view[got:]], at + got)
        if k <= 0:
            return False
        got += k
    return True


def _read_chunk(fd: int, i: int, size: int, chunk: int, want: int, scratch: torch.Tensor) -> memoryview | None:
    """Chunk ``i`` of the copy open at ``fd``, read into ``scratch`` (a reused buffer of at least
    ``chunk`` bytes: no fresh memory per chunk), when its CRC32C is ``want``; else None. The view
    is valid until the next read into ``scratch``."""
    view = scratch.numpy().data.cast("B")[: min(chunk, size - i * chunk)]
    return view if _read_into(fd, i * chunk, view) and crc32c(view) == want else None


class Copies:
    """Read descriptors of this host's copies, each opened once (never through a link: a copy
    that cannot be opened so reads as missing), and the read-only mappings a holder sends
    from (``mapped``); ``close`` releases them all."""

    def __init__(self, layout: RamLayout) -> None:
        self.layout = layout
        self._fds: dict[str, int | None] = {}
        self._maps: dict[str, torch.Tensor | None] = {}  # the tensor holds its mapping: dropped, unmapped

    def _fd(self, path: str) -> int | None:
        if path not in self._fds:
            try:
                self._fds[path] = self.layout.open_read(path)
            except OSError:  # missing, or a link where a folder or the file belongs (UnsafePathError)
                self._fds[path] = None
        return self._fds[path]

    def chunk(self, path: str, i: int, size: int, chunk: int, want: int, scratch: torch.Tensor) -> memoryview | None:
        """``_read_chunk`` of the copy at ``path``; None when it is missing or fails its CRC32C."""
        fd = self._fd(path)
        return None if fd is None else _read_chunk(fd, i, size, chunk, want, scratch)

    def mapped(self, path: str, i: int, size: int, chunk: int) -> torch.Tensor | None:
        """Chunk ``i`` of the copy at ``path`` (``size`` bytes long) as a view of a private,
        read-only use mapping of the file, unchecked; None when the copy is missing or shorter
        than ``size``. A holder sends it as it is: the bytes go from the page cache into the
        socket with no copy into a buffer of ours first (a ``preadv`` into one cost ~25% of a
        transfer on the 2-core bench). The mapping covers the length ``fstat`` found; only a
        process of this user truncating the file while it is sent (nothing unickpt does to a
        committed copy; the folders are this user's own, ``folders``) could fault it (SIGBUS)."""
        if path not in self._maps:
            fd, whole = self._fd(path), None
            if fd is not None and size > 0 and os.fstat(fd).st_size >= size:
                # MAP_PRIVATE + PROT_WRITE: a writable buffer for torch, copy-on-write, never written
                m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                whole = torch.frombuffer(m, dtype=torch.uint8)
            self._maps[path] = whole
        whole = self._maps[path]
        return None if whole is None else whole[i * chunk : min(size, (i + 1) * chunk)]

    def bad_chunks(self, path: str, size: int, chunk: int, crcs: list[int], scratch: torch.Tensor) -> list[int]:
        """The chunks of the copy at ``path`` that do not verify (all of them when it is missing)."""
        return [i for i, w in enumerate(crcs) if self.chunk(path, i, size, chunk, w, scratch) is None]

    def close(self) -> None:
        """After every send from a mapping has completed (``_exchange`` waits for them): each
        mapping goes with the last tensor that views it."""
        self._maps.clear()
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()


def _materialise(
    tg: TierGroup, layout: RamLayout, d: dict[str, Any], fetch: bool, load_verifies: bool, feed: bool = False
) -> tuple[int, dict[str, int], list[str], list[str], list[str], Exception | None]:
    """Steps 2-3 on this rank (``fetch=False``: the metadata and this host's own files only, and
    step 3 only for those it holds no copy of): (bytes from this host's RAM, bytes per sending
    peer, failed copies, the files not complete here, the first file error here: this host then
    asks for nothing more but still serves and receives its part of every round, so that no
    peer waits for it; ``recover`` raises it on every rank).

    ``load_verifies`` (``fetch=False`` only: the load that follows checks every chunk's CRC32C
    against the metadata): a primary here is taken as it is and a replica here of one of this
    host's files is hard-linked, without reading a byte; a copy that fails the load's check
    sends ``load_latest`` to the ``fetch=True`` pass, which verifies every copy before use. The
    metadata, which has no checksum of its own, is verified here always. ``feed`` (with
    ``load_verifies``): a data file no copy here holds is not fetched but returned in the fifth
    place: the load reads it from its holder (``feed``)."""
    chunk = int(d["chunk"])
    peers, failed = dict[str, int](), list[str]()
    need: dict[str, dict[int, list[str]]] = {}  # name -> chunk -> hosts that failed it
    parts: dict[str, int] = {}
    left: set[str] = set()  # files this pass does not complete here (fetch=False)
    fed: list[str] = []  # files the load reads from their holders (feed)
    scratch = torch.empty(chunk if tg.is_agent else 0, dtype=torch.uint8)  # every chunk read goes here
    copies = Copies(layout)
    errors: list[Exception] = []
    local = 0
    try:
        if tg.is_agent:
            try:
                local = _complete_here(tg.host, layout, d, fetch, load_verifies and not fetch, copies, scratch,
                                       need, parts, left, failed, fed if feed else None)  # fmt: skip
            except Exception as e:
                errors.append(e)
                need.clear()  # ask the peers for nothing: this host's part has failed
                fed.clear()
        # fetch=False: only the files no copy here holds
        _fetch_rounds(tg, layout, d, need, parts, peers, failed, copies, errors)
        lacking = sorted(set(d["files"]) if errors else set(need) | left)
        return local, peers, failed, lacking, sorted(fed), (errors[0] if errors else None)
    finally:
        copies.close()
        for fd in parts.values():
            os.close(fd)


def _complete_here(
    host: str, layout: RamLayout, d: dict[str, Any], fetch: bool, trust: bool, copies: Copies,
    scratch: torch.Tensor, need: dict[str, dict[int, list[str]]], parts: dict[str, int], left: set[str],
    failed: list[str], fed: list[str] | None = None,
) -> int:  # fmt: skip
    """Step 2 on a host's agent: each file this pass completes, from this host's own copies
    (``trust``: the load verifies, so copies here are taken without reading them); fills
    ``need`` (chunks no copy here supplied), ``parts`` (open ``.unickpt-part`` files), ``left``
    and ``failed``, and ``fed`` (when given: the data files no copy here holds, left to the
    load to read from their holders); returns the bytes taken from this host's RAM."""
    chunk, stepdir = int(d["chunk"]), d["stepdir"]
    local = 0
    for name, (size, crcs) in d["files"].items():
        final = layout.primary(stepdir, name)
        mine = [h for h in d["holders"][name] if h[0] == host]
        own = name == METADATA_FILE or d["holders"][name][0][2] == host
        if not fetch and not own and fed is None:
            left.add(name)  # another host's file: not read by a same-layout restart
            continue
        ordered = sorted(mine, key=lambda h: h[1] != "primary")  # the primary here first
        if not ordered and fed is not None and name != METADATA_FILE:
            fed.append(name)  # the load reads what it needs of it from a holder (``feed``)
            continue
        trusted = trust and name != METADATA_FILE  # the metadata has no checksum of its own
        if ordered and ordered[0][1] == "primary":
            bad = [] if trusted else copies.bad_chunks(final, size, chunk, crcs, scratch)
            if not bad:
                local += size
                continue
            failed += [f"{host}:{name}#{i} (CRC32C mismatch in this host's RAM)" for i in bad]
        elif ordered:
            held = _path_on(layout, d, name, ordered[0][1], ordered[0][2])
            if (trusted or not copies.bad_chunks(held, size, chunk, crcs, scratch)) and layout.link(
                held, final + ".unickpt-part"
            ):
                # this host's replica (verified now or by the load): linked, not copied; another
                # host's file (``feed``) counts only if the load reads it (not known here)
                local += size if own or fetch else 0
                continue
        parts[name] = fd = layout.create(final + ".unickpt-part")
        truncate(fd, size)
        for i, want in enumerate(crcs):
            for h in ordered:
                data = copies.chunk(_path_on(layout, d, name, h[1], h[2]), i, size, chunk, want, scratch)
                if data is not None:
                    pwrite_all(fd, data, i * chunk)
                    local += len(data)
                    break
                if h[1] != "primary":
                    failed.append(f"{host}:{name}#{i} (replica here failed CRC32C)")
            else:
                need.setdefault(name, {})[i] = [host]
        if not fetch and ordered and name in need:
            left.add(name)  # a copy here failed: the fetch=True pass verifies and names every copy
            del need[name]
    return local


def _fetch_rounds(tg: TierGroup, layout: RamLayout, d: dict[str, Any], need: dict[str, dict[int, list[str]]],
                  parts: dict[str, int], peers: dict[str, int], failed: list[str],
                  copies: Copies, errors: list[Exception]) -> None:  # fmt: skip
    ring = list(tg.hosts)
    slots: list[torch.Tensor | None] = [None] * (2 * _WINDOW)
    while True:
        if errors:
            need.clear()  # this host has failed: it serves its peers but asks for nothing more
        asks = tg.all_gather([tg.host, {n: {str(i): f for i, f in c.items()} for n, c in need.items()}])
        plan = []
        for requester, wants in sorted((h, w) for h, w in asks if w):
            nearest = ring_after(ring, requester)
            for name in sorted(wants):
                holders = {h[0]: h for h in d["holders"][name]}
                for i in sorted(wants[name], key=int):
                    src = next((h for h in nearest if h in holders and h not in wants[name][i]), None)
                    if src is not None:
                        plan.append((src, requester, name, int(i), holders[src]))
        if not plan:
            return
        if tg.is_agent:
            _exchange(tg, layout, d, plan, need, parts, peers, failed, copies, errors, slots)


_WINDOW = 2  # chunks a host has in flight each way: the next read (or write) overlaps a transfer


def _exchange(tg: TierGroup, layout: RamLayout, d: dict[str, Any], plan: list[Any],
              need: dict[str, dict[int, list[str]]], parts: dict[str, int], peers: dict[str, int],
              failed: list[str], copies: Copies, errors: list[Exception],
              slots: list[torch.Tensor | None]) -> None:  # fmt: skip
    """This host's part of one round's transfers (step 3), ``plan`` in the same order on every
    rank: as holder it sends (``isend``), for each chunk it serves, a flag (a copy here or not)
    and the chunk straight from a mapping of its copy (``Copies.mapped``; without a copy, a
    free send slot's bytes, so that the requester's receive completes); as requester it posts
    the receives (``irecv``) ahead and lands the oldest arrival when it needs its slot: CRC32C
    checked, then written into the part, or the copy recorded as failed and asked of the next
    holder in the next round. Up to ``_WINDOW`` chunks each way are in flight (``slots``: 2 x
    ``_WINDOW`` chunk buffers, made when first used, kept for the next round), so a holder's
    next send and a requester's last write overlap the transfers. Deadlock-free: every wait is
    for a transfer earlier in the global order, whose two ends have both posted it."""
    chunk = int(d["chunk"])
    send_free, recv_free = list(range(_WINDOW)), list(range(_WINDOW, 2 * _WINDOW))
    sending: deque[tuple[int, list[Any], torch.Tensor]] = deque()
    receiving: deque[tuple[int, list[Any], torch.Tensor, tuple[str, str, int, int]]] = deque()

    def buffer(slot: int, n: int) -> torch.Tensor:
        if slots[slot] is None:
            slots[slot] = torch.empty(chunk, dtype=torch.uint8)
        out = slots[slot]
        assert out is not None
        return out[:n]

    def land() -> None:
        slot, works, flag, (src, name, i, n) = receiving.popleft()
        for w in works:
            w.wait()
        recv_free.append(slot)
        buf = buffer(slot, n)
        sent = bool(flag.item())
        if sent and crc32c(buf.numpy().data) == d["files"][name][1][i]:
            try:
                pwrite_all(parts[name], buf.numpy().data.cast("B"), i * chunk)
            except OSError as e:  # keep receiving this round; ask for nothing more
                errors.append(e)
            peers[src] = peers.get(src, 0) + n
            del need[name][i]
            if not need[name]:
                del need[name]
            return
        failed.append(f"{src}:{name}#{i} (" + ("its copy failed CRC32C" if sent else "no readable copy") + ")")
        need[name][i].append(src)

    try:
        for src, requester, name, i, holder in plan:
            size = d["files"][name][0]
            n = min(chunk, size - i * chunk)
            if tg.host == src:
                if not send_free:
                    slot, works, _ = sending.popleft()
                    for w in works:
                        w.wait()
                    send_free.append(slot)
                slot = send_free.pop()
                view = copies.mapped(_path_on(layout, d, name, holder[1], holder[2]), i, size, chunk)
                buf = buffer(slot, n) if view is None else view  # no copy: the requester learns so from the flag
                flag = torch.tensor([int(view is not None)], dtype=torch.int64)
                dst = tg.agents[requester]
                sending.append((slot, [tg.isend(flag, dst), tg.isend(buf, dst)], flag))
            elif tg.host == requester:
                if not recv_free:
                    land()
                slot = recv_free.pop()
                flag = torch.zeros(1, dtype=torch.int64)
                at = tg.agents[src]
                receiving.append((slot, [tg.irecv(flag, at), tg.irecv(buffer(slot, n), at)], flag, (src, name, i, n)))
        while receiving:
            land()
    finally:
        for _, works, _ in sending:
            for w in works:
                w.wait()


def _finish(layout: RamLayout, d: dict[str, Any], host: str) -> None:
    """Rename the parts (the metadata last) and record the materialised files in this host's
    marker, so that retention removes them with the step."""
    stepdir = d["stepdir"]
    names = sorted(d["files"], key=lambda n: n == METADATA_FILE)
    made = []
    for name in names:
        if layout.exists(layout.primary(stepdir, name) + ".unickpt-part"):
            layout.finish_part(layout.primary(stepdir, name))
            made.append(name)
    if not made:
        return
    rec = layout.markers().get(stepdir)
    if rec is None or rec["save_id"] != d["save_id"]:
        rec = {"format": "unickpt-ram-commit/1", "stepdir": stepdir, "step": d["step"], "save_id": d["save_id"],
               "chunk": d["chunk"], "host": host, "required": list(d["files"]), "files": []}  # fmt: skip
    kept = [e for e in rec["files"] if not (e["where"] == "primary" and e["name"] in made)]
    for name in made:
        size, crcs = d["files"][name]
        origin = next(h[2] for h in d["holders"][name])
        kept.append({"name": name, "origin": origin, "where": "primary", "size": size, "crcs": crcs})
    layout.write_marker(stepdir, {**rec, "files": kept})


def _discard(layout: RamLayout, d: dict[str, Any], names: Any) -> None:
    """Remove the parts of ``names`` (files this host could not complete)."""
    for name in names:
        layout.unlink(layout.primary(d["stepdir"], name) + ".unickpt-part")
