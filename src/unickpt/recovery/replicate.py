"""Copy one committed step's files from each host's RAM to its replica hosts, then commit it in RAM.

``replicate_step`` runs on the tier's worker thread of every rank (``tier.RamTier.after_save``
queues it after the step's ordinary save on the node-local fast root has committed), steps in
save order, so every rank runs the same collectives of the tier group in the same order:

1. rank 0 broadcasts the step's metadata (it alone holds it: the save wrote it on its host);
2. each host's agent lists the step's data files it holds (its ranks wrote them), with the CRC32C
   of every ``chunk`` bytes, and all ranks gather the lists: each file must have exactly one
   origin host;
3. the transfers (``_transfer``), all (origin, target) pairs of the placement at once: each
   agent streams its files chunk by chunk to each of its replica holders while it receives the
   streams of the hosts it holds replicas for (``isend``/``irecv``, one chunk of each stream in
   flight, one buffer per stream); the target's agent checks each chunk's CRC32C on arrival and
   appends it to ``replicas/<origin>/step_N/<name>.unickpt-part``, renamed when complete; every
   host but rank 0's also writes the metadata from step 1 as a replica (first);
4. a gather of every rank's outcome (``TierGroup.fail_together``: a rank's file error, e.g. a
   link planted where a replica folder belongs, is caught, its streams still run to their end,
   and every rank raises the same error); only when every copy on every host was written and
   verified does each agent write its commit marker (``inventory.RamLayout.write_marker``), then
   drops its steps beyond the newest ``keep`` committed ones (marker first, then the files it
   names). A failure (or a crash) before step 4 leaves no marker: the previous committed step
   stays the newest one offered.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..errors import IntegrityError
from ..format.checksums import chunk_crcs, crc32c
from ..format.codec import decode_metadata
from ..format.records import METADATA_FILE
from ..storage.local_files import write_all
from .folders import as_unsafe_folder
from .group import FAMILY_ORDER, TierGroup, family_of
from .inventory import MARKER_FORMAT, RamLayout, chunk_crcs_of
from .placement import transfer_pairs

__all__ = ["replicate_step", "drop_old"]


def replicate_step(
    tg: TierGroup,
    layout: RamLayout,
    step: int,
    stepdir: str,
    raw0: bytes | None,
    chunk: int,
    nonfinite: list[str] | None = None,
    check: Callable[[], str | None] | None = None,
) -> list[str]:
    """Steps 1-4 of the module docstring (the retention of step 4 is ``drop_old``, called by
    ``tier.RamTier`` after the durable copy when one is due). ``check``: what makes this host's
    folders of the step unsafe (``folders.step_folder_problem``), asked when a file operation
    fails: a folder swapped for a link meanwhile is then the ``ConfigurationError`` naming it.
    A rank's file error never stops its part of the transfers (its peers would wait for it):
    it is gathered with step 2's lists or step 4's outcomes, and every rank raises the same."""
    raw = tg.broadcast_bytes(raw0)
    md = decode_metadata(raw, f"{layout.root}/{stepdir}/{METADATA_FILE}")  # the same bytes on every rank
    names = list(md.files)  # relative to the step folder: data/<save id>/...
    host0 = tg.rank_hosts[0]
    mine: dict[str, list[Any]] = {}
    error: Exception | None = None
    if tg.is_agent:
        try:
            _drop_older_save(layout, stepdir, md.save_id, names)
            for name in names:
                path = layout.primary(stepdir, name)
                try:
                    size = os.lstat(path).st_size
                except FileNotFoundError:
                    continue
                mine[name] = [size, chunk_crcs_of(layout, path, size, chunk)]
            if tg.host == host0:
                mine[METADATA_FILE] = [len(raw), chunk_crcs([raw], chunk)]
        except Exception as e:
            error = as_unsafe_folder(e, check)
    listing = {"host": tg.host, "files": mine if tg.is_agent else None, "bad": nonfinite or []}
    what = f"step {step} was not replicated (the previous committed step stays in use)"
    gathered = tg.fail_together(error, what, listing)
    bad = sorted({n for g in gathered for n in g["bad"]})
    origin_of: dict[str, str] = {}
    files: dict[str, list[Any]] = {}
    for g in gathered:
        if g["files"] is None:
            continue
        for name, entry in g["files"].items():
            if name in origin_of:
                raise IntegrityError(f"{stepdir}/{name} was written on two hosts ({origin_of[name]}, {g['host']})")
            origin_of[name], files[name] = g["host"], entry
    missing = [n for n in names if n not in origin_of]
    if missing:
        raise IntegrityError(
            f"step {step}: {len(missing)} data file(s) are on no host's RAM, e.g. {missing[0]}: "
            "the step is not replicated (the previous committed step stays in use)"
        )
    held: list[dict[str, Any]] = []
    errors: list[Exception] = []
    if tg.is_agent:
        held += [_entry(n, tg.host, "primary", files[n]) for n in sorted(files) if origin_of[n] == tg.host]
        if tg.host != host0:
            try:
                _write_replica(layout, host0, stepdir, METADATA_FILE, [raw], files[METADATA_FILE], chunk)
                held.append(_entry(METADATA_FILE, host0, "replica", files[METADATA_FILE]))
            except Exception as e:
                errors.append(e)
        sends, recvs = [], []
        for origin, target in transfer_pairs(tg.placement):
            theirs = sorted(n for n in files if origin_of[n] == origin and n != METADATA_FILE)
            if tg.host == origin:
                sends.append(_Outgoing(layout, stepdir, theirs, files, chunk, tg.agents[target]))
            elif tg.host == target:
                recvs.append(_Incoming(layout, origin, stepdir, theirs, files, chunk, tg.agents[origin]))
        _transfer(tg, sends, recvs)  # file errors stay on the streams: every chunk is still sent and taken
        errors += [e for e in (*(s.error for s in sends), *(r.failure() for r in recvs)) if e is not None]
        for stream in recvs:
            held += [_entry(name, stream.origin, "replica", files[name]) for name in stream.names]
    if errors:  # the cause first: a file error (an unsafe folder) before the CRC mismatch it caused
        error = min((as_unsafe_folder(e, check) for e in errors), key=lambda e: FAMILY_ORDER.index(family_of(e)))
    tg.fail_together(error, f"step {step} was not committed in RAM (the previous committed step stays in use)")
    if not tg.is_agent:
        return bad
    layout.write_marker(
        stepdir,
        {
            "format": MARKER_FORMAT,
            "stepdir": stepdir,
            "step": step,
            "save_id": md.save_id,
            "chunk": chunk,
            "host": tg.host,
            "required": [*names, METADATA_FILE],
            "files": held,
            "nonfinite": bad,
        },
    )
    return bad


def _drop_older_save(layout: RamLayout, stepdir: str, save_id: str, names: list[str]) -> None:
    """This step saved again (a job resumed from an older step): the old save's copies go first,
    but not the files the new save wrote under the same names (its metadata, in place)."""
    old = layout.markers().get(stepdir)
    if old is not None and old["save_id"] != save_id:
        new = {*names, METADATA_FILE}
        files = [e for e in old["files"] if not (e["where"] == "primary" and e["name"] in new)]
        layout.drop_step(stepdir, {**old, "files": files})


def _entry(name: str, origin: str, where: str, sc: list[Any]) -> dict[str, Any]:
    return {"name": name, "origin": origin, "where": where, "size": sc[0], "crcs": sc[1]}


class _Outgoing:
    """One (this host -> ``dst``) stream: the files' chunks in order (sorted names, offsets),
    read into one reused buffer."""

    def __init__(self, layout: RamLayout, stepdir: str, names: list[str], files: dict[str, list[Any]],
                 chunk: int, dst: int) -> None:  # fmt: skip
        self.peer, self.layout = dst, layout
        self.pieces = [(layout.primary(stepdir, n), at, min(chunk, files[n][0] - at))
                       for n in names for at in range(0, files[n][0], chunk)]  # fmt: skip
        self.buf = torch.empty(max((p[2] for p in self.pieces), default=0), dtype=torch.uint8)
        self.error: Exception | None = None  # the first file error; the stream goes on with zeros

    def next(self) -> torch.Tensor:
        path, at, n = self.pieces.pop(0)
        out = self.buf[:n]
        got = 0
        try:
            fd = self.layout.open_read(path)
            try:
                got = os.preadv(fd, [out.numpy().data], at)
            finally:
                os.close(fd)
        except OSError as e:  # e.g. a link planted in the file's place: never read through it
            self.error = self.error or e
        if got != n:  # gone or shrank since its CRC was taken: send zeros, the receiver's CRC check fails
            out[got:] = 0
        return out


class _Incoming:
    """One (``src`` -> this host) stream: each file's chunks appended to its replica's
    ``.unickpt-part``, each checked against its CRC32C, renamed when complete; a mismatch still
    takes every chunk of the stream (the sender's order), then ``failure`` names it. A file error
    (e.g. a link planted where a replica folder belongs: ``RamLayout.create`` refuses it) stops
    the writing, not the stream: the rest is taken and dropped, ``failure`` returns the error."""

    def __init__(self, layout: RamLayout, origin: str, stepdir: str, names: list[str],
                 files: dict[str, list[Any]], chunk: int, src: int) -> None:  # fmt: skip
        self.peer, self.origin, self.names, self.layout, self.stepdir = src, origin, names, layout, stepdir
        self.pieces = [(n, i, min(chunk, files[n][0] - at), files[n][1][i])
                       for n in names for i, at in enumerate(range(0, files[n][0], chunk))]  # fmt: skip
        self.buf = torch.empty(max((p[2] for p in self.pieces), default=0), dtype=torch.uint8)
        self.fd: int | None = None
        self.open_name = ""
        self.bad: dict[str, list[int]] = {}
        self.error: Exception | None = None
        try:
            for name in names:
                if files[name][0] == 0:  # no chunk will arrive: the empty replica now
                    os.close(layout.create(self._final(name) + ".unickpt-part"))
                    layout.finish_part(self._final(name))
        except Exception as e:
            self.error = e

    def slot(self) -> torch.Tensor:
        return self.buf[: self.pieces[0][2]]

    def take(self, data: torch.Tensor) -> None:
        name, i, _, want = self.pieces.pop(0)
        view = data.numpy().data.cast("B")
        if crc32c(view) != want:
            self.bad.setdefault(name, []).append(i)
        if self.error is not None:  # the stream is only drained
            return
        try:
            if name != self.open_name:
                self.open_name, self.fd = name, self.layout.create(self._final(name) + ".unickpt-part")
            assert self.fd is not None
            write_all(self.fd, [view])
            if not self.pieces or self.pieces[0][0] != name:
                self._close(name)
        except Exception as e:
            self.error = e
            self.abort()

    def _final(self, name: str) -> str:
        return self.layout.replica(self.origin, self.stepdir, name)

    def _close(self, name: str) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd, self.open_name = None, ""
        self.layout.finish_part(self._final(name), keep=name not in self.bad)

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def failure(self) -> Exception | None:
        """The stream's file error, else its first CRC32C mismatch, else None."""
        if self.error is not None:
            return self.error
        for name, bad in self.bad.items():
            return IntegrityError(
                f"replica of {self.origin}:{self.stepdir}/{name}: chunk(s) {bad[:5]} failed CRC32C on arrival"
            )
        return None


def _transfer(tg: TierGroup, sends: list[_Outgoing], recvs: list[_Incoming]) -> None:
    """Every stream of this host at once, one chunk of each in flight per round (``isend`` /
    ``irecv``, then wait for all): a host sends its files to its replica holders while it
    receives the files it holds for others, instead of the transfers running one pair after the
    other. Each pair's chunks keep their order (point-to-point messages between two ranks of a
    group arrive in the order sent). Bounded: one chunk buffer per stream."""
    import torch.distributed as dist

    try:
        while any(s.pieces for s in sends) or any(r.pieces for r in recvs):
            works = [dist.isend(s.next(), dst=s.peer, group=tg.group) for s in sends if s.pieces]
            arriving = [(r, r.slot()) for r in recvs if r.pieces]
            works += [dist.irecv(buf, src=r.peer, group=tg.group) for r, buf in arriving]
            for w in works:
                if w is not None:  # None only for a rank outside the group: never here
                    w.wait()
            for r, buf in arriving:
                r.take(buf)
    finally:
        for r in recvs:
            r.abort()


def _write_replica(
    layout: RamLayout, origin: str, stepdir: str, name: str, chunks: Any, sc: list[Any], chunk: int
) -> None:
    """Write the chunks (iterable of buffers) as ``name``'s replica, each checked against its
    CRC32C; a mismatch still consumes every chunk (the sender's stream), then raises."""
    final = layout.replica(origin, stepdir, name)
    fd = layout.create(final + ".unickpt-part")
    bad = []
    try:
        for i, data in enumerate(chunks):
            view = memoryview(data).cast("B")
            if crc32c(view) != sc[1][i]:
                bad.append(i)
            write_all(fd, [view])
    finally:
        os.close(fd)
    layout.finish_part(final, keep=not bad)
    if bad:
        raise IntegrityError(f"replica of {origin}:{stepdir}/{name}: chunk(s) {bad[:5]} failed CRC32C on arrival")


def drop_old(layout: RamLayout, keep: int, protect: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """This host's RAM retention (its agent): the committed steps beyond the newest ``keep``, but
    never ``protect`` (a step due on the durable tier whose durable copy is not committed); the
    (stepdir, marker) of each step dropped."""
    markers = layout.markers()
    order = sorted(markers, key=lambda s: int(markers[s]["step"]))
    dropped = []
    for stepdir in order[: max(0, len(order) - keep)]:
        if stepdir == protect:
            continue
        layout.drop_step(stepdir, markers[stepdir])
        dropped.append((stepdir, markers[stepdir]))
    return dropped
