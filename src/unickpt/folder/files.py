"""Whether a checkpoint's data files are all there: one stat pool, one expected-size rule, one
list of problems, for every place that asks.

The rule. A data file the metadata names is *complete* when a regular file of that name (not a
link, not a folder, not a special file; never followed) holds at least its expected size:
the size the metadata records (format version 3, ``checksums.file_sizes``), or for older
versions, which record none, the end of the last tensor shard or blob it holds
(``expected_sizes``). A file is *missing* (no such name, or a folder there), *not a file*
(a link or a special file: stat refused it), or *short* (fewer bytes than expected): each is
a problem, and the checkpoint is not complete.

A file *longer* than recorded is complete, with a note. Every byte the metadata names is there
and covered by its checksums; a load reads nothing past the recorded end, so it loads exactly
what was saved. What grew such a file (a copy tool that pads, a user appending) is unknown, and
``verify`` says so in a note, but refusing it would make ``CheckpointManager`` skip (and its
retention keep forever) a step that loads and verifies bit for bit. So load, ``verify``,
``CheckpointManager`` (``latest_step``, ``list_checkpoints``, ``unickpt ls``) and retention
all call it complete.

The commit is the one exception, and it is stricter on purpose (``written_problems``): rank 0
checks the files this save just wrote under ``data/<save_id>/``, a folder no other save uses,
against the sizes their writers reported. There, any other size (longer too) means bytes this
save did not write: another writer in the same folder, or a storage that did not keep what it
was given. The checksums about to be published were computed over what was written, so
nothing is published.

Callers: ``engine.load.reader`` (the files a rank reads), ``engine.load.data_files`` (resize and
the tools' piece readers), ``engine.read.read_blob``, ``ops.verify`` (reported, never raised),
``CheckpointManager`` (a step's status, which retention and ``unickpt ls`` use) and
``engine.save.commit.check_written_files``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import CheckpointError, MissingDataFileError, TruncatedDataFileError
from ..format.names import printable
from ..format.records import Metadata
from ..storage.base import Storage

__all__ = [
    "COMPLETE",
    "LONGER",
    "MISSING",
    "NOT_A_FILE",
    "SHORT",
    "DataFile",
    "expected_sizes",
    "stat_sizes",
    "data_files",
    "from_sizes",
    "problems",
    "raise_problem",
    "written_problems",
]

COMPLETE = "complete"  # exactly the expected size
LONGER = "longer"  # more bytes than expected: complete, with a note (see the module docstring)
MISSING = "missing"  # no such name (or a folder there)
NOT_A_FILE = "not a file"  # a link or a special file in its place: stat refused it
SHORT = "short"  # fewer bytes than expected

Stat = int | None | CheckpointError  # a regular file's size; None: missing; the error: refused


@dataclass(frozen=True, slots=True)
class DataFile:
    """One data file as found on storage against what it must hold."""

    index: int  # in ``Metadata.files`` (or in the save's file list, at commit)
    name: str  # as the metadata names it
    expected: int  # bytes it must hold (``expected_sizes``)
    size: int | None  # bytes on storage; None: missing or not a regular file
    refused: CheckpointError | None = field(default=None, compare=False)  # why stat refused it

    @property
    def state(self) -> str:
        if self.refused is not None:
            return NOT_A_FILE
        if self.size is None:
            return MISSING
        if self.size < self.expected:
            return SHORT
        return LONGER if self.size > self.expected else COMPLETE

    @property
    def complete(self) -> bool:
        """Whether a load finds every byte it needs here (a longer file is complete)."""
        return self.state in (COMPLETE, LONGER)

    def describe(self, where: str = "", recorded: bool = True) -> str:
        """One line: ``data file <where/name> is missing`` / ``has N bytes, the metadata records M``;
        ``where``: the folder or URL to put before the name; ``recorded``: the expected size was
        recorded (else it is what the tensors there need)."""
        path = f"{where.rstrip('/')}/{printable(self.name)}" if where else printable(self.name)
        state = self.state
        if state == MISSING:
            return f"data file {path} is missing"
        if state == NOT_A_FILE:
            return f"data file {path} is not a regular file ({self.refused})"
        verb = "records" if recorded else "needs"
        tail = "" if state != LONGER else " (the bytes past the recorded end are never read)"
        return f"data file {path} has {self.size} bytes, the metadata {verb} {self.expected}{tail}"


def expected_sizes(md: Metadata) -> list[int]:
    """The bytes each data file of ``md`` must hold: its recorded size (format version 3), else
    the end of the last shard or blob it holds. The decoder has checked that every range lies
    inside a recorded size, so the larger of the two is the recorded one."""
    sums = md.checksums
    recorded = [sums.file_size(i) if sums is not None else None for i in range(len(md.files))]
    if all(r is not None for r in recorded):
        return [int(r) for r in recorded if r is not None]
    ends = [0] * len(md.files)
    for t in md.tensors.values():
        for s in t.shards:
            if s.byte_length:
                ends[s.file_index] = max(ends[s.file_index], s.byte_offset + s.byte_length)
    for b in md.blobs.values():
        if b.byte_length:
            ends[b.file_index] = max(ends[b.file_index], b.byte_offset + b.byte_length)
    return [max(e, r or 0) for e, r in zip(ends, recorded)]


def stat_sizes(storage: Storage, names: Sequence[str], threads: int = 16) -> list[Stat]:
    """``storage.size`` of every name, in parallel (up to ``threads``; a few names in this
    thread): the size of a regular file, None when missing (or a folder), the error when the
    storage refuses the name (a link, a special file; a failing stat)."""

    def one(name: str) -> Stat:
        try:
            return storage.size(name)
        except CheckpointError as e:
            return e

    if len(names) <= 4 or threads <= 1:
        return [one(n) for n in names]
    with ThreadPoolExecutor(min(threads, len(names)), thread_name_prefix="unickpt-stat") as pool:
        return list(pool.map(one, names))


def data_files(
    storage: Storage, md: Metadata, prefix: str = "", indices: Iterable[int] | None = None, threads: int = 16
) -> list[DataFile]:
    """The data files of ``md`` (``indices``: only these, in this order; all by default) as
    found under ``prefix`` in ``storage``: stats only, nothing read."""
    order = list(range(len(md.files))) if indices is None else list(indices)
    if not order:
        return []
    sums = md.checksums
    recorded = [sums.file_size(i) if sums is not None else None for i in order]
    if all(r is not None for r in recorded):  # format 3: no walk over the shards (one blob's read)
        expected = dict(zip(order, (int(r or 0) for r in recorded)))
    else:
        expected = dict(enumerate(expected_sizes(md)))
    stats = stat_sizes(storage, [prefix + md.files[i] for i in order], threads)
    return [_found(i, md.files[i], expected[i], s) for i, s in zip(order, stats)]


def from_sizes(md: Metadata, sizes: dict[str, int | None]) -> list[DataFile]:
    """The data files of ``md`` from sizes already taken (``ops.verify.file_sizes``)."""
    expected = expected_sizes(md)
    return [DataFile(i, name, expected[i], sizes.get(name)) for i, name in enumerate(md.files)]


def problems(files: Iterable[DataFile]) -> list[DataFile]:
    """The files that make a checkpoint incomplete (missing, not a file, short), in order."""
    return [f for f in files if not f.complete]


def raise_problem(
    files: Iterable[DataFile], md: Metadata, url: str, prefix: str = "", holding: dict[int, str] | None = None
) -> None:
    """Raise for the first incomplete file of ``files`` (nothing when all are complete): the
    storage's own error for a name it refused, ``MissingDataFileError``, ``TruncatedDataFileError``.
    ``prefix`` starts the message (``"rank 3: "``); ``holding``: per file index, what the
    message says it holds (default: a tensor or blob found there)."""
    for f in problems(files):
        if f.refused is not None:
            raise f.refused
        held = (holding or {}).get(f.index) or _a_holding(md, f.index)
        text = f"{prefix}{f.describe(url, md.checksums is not None and md.checksums.file_size(f.index) is not None)}"
        text += f" (holding {held})" if held else ""
        if f.state == MISSING:
            raise MissingDataFileError(text)
        raise TruncatedDataFileError(text + ": truncated, or the metadata claims more than was saved")


def written_problems(storage: Storage, written: dict[str, int], threads: int = 16) -> list[DataFile]:
    """The commit's check (see the module docstring): of the files a save just wrote (name ->
    the size its writer reported), every one not of exactly that size, in order."""
    names = list(written)
    stats = stat_sizes(storage, names, threads)
    found = [_found(i, n, written[n], s) for i, (n, s) in enumerate(zip(names, stats))]
    return [f for f in found if f.state != COMPLETE]


def _found(index: int, name: str, expected: int, stat: Stat) -> DataFile:
    if isinstance(stat, CheckpointError):
        return DataFile(index, name, expected, None, stat)
    return DataFile(index, name, expected, stat)


def _a_holding(md: Metadata, file_index: int) -> str:
    """A tensor or blob whose bytes are in file ``file_index`` (for messages), or ''."""
    for fqn, t in md.tensors.items():
        if any(s.file_index == file_index and s.byte_length for s in t.shards):
            return repr(printable(fqn))
    for b in md.blobs.values():
        if b.file_index == file_index:
            return f"blob {printable(b.key)!r}"
    return ""
