"""The files ``merge`` and ``convert --to dcp`` write into their output folder: none is ever seen
under its final name before it is complete, and a failure leaves none behind.

Each file is written under a temporary name (``<name>.unickpt-partial``, or DCP's whole output in
the folder ``.unickpt-partial/``) and renamed to its final name once complete and fsynced
(``storage.local.LocalStorage`` and ``storage.local_files``: created exclusively, never through a
link; ``rename`` relative to folder descriptors opened without following links). When the command
fails or is interrupted (Ctrl-C, a full disk), every file this ``OutputFiles`` created, temporary
or renamed, is removed again (only those: the folder was empty when the command started,
``folder.target.prepare_output_folder``), and the failure becomes one line naming the file: an
``OSError`` anywhere in the error's chain (``torch.save``'s ``enforce fail at
inline_container.cc`` wraps the ``ENOSPC`` of its write; DCP's ``CheckpointException`` wraps its
rank's error) is raised as the ``StorageError`` of ``storage.local_files.storage_error`` ("write
<file> failed (disk full): ..."); a ``KeyboardInterrupt`` anywhere in it is raised as
``KeyboardInterrupt`` (the CLI: exit 130). A killed process (SIGKILL) leaves only temporary names
behind.

Order of use (``merge.merge``, ``convert.to_dcp``): ``prepare_output_folder(out)`` -> ``with
OutputFiles(out) as files:`` -> ``files.stream(name)`` (a file object, for data streamed in
pieces or by ``torch.save``), ``files.write(name, data)`` (small files), or ``files.staging()`` +
``files.publish_staged(last=".metadata")`` (a folder another writer fills: DCP) -> on leaving the
block the folder is fsynced (success) or cleaned (failure).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import BinaryIO

from ..errors import CheckpointError
from ..format.hf_manifest import PARTIAL
from ..storage import local_files
from ..storage.local import LocalStorage
from ..storage.local_files import storage_error

__all__ = ["OutputFiles", "STAGING"]

STAGING = PARTIAL  # the folder inside OUT that DCP writes into before its files are renamed into OUT


class OutputFiles:
    """The files one command writes into the folder ``out`` (module docstring)."""

    def __init__(self, out: str) -> None:
        self.store = LocalStorage(out)
        self.out = self.store.root
        self._temps: list[str] = []  # created under a temporary name, not yet renamed
        self._final: list[str] = []  # renamed to their final name
        self._staged = False
        self._current: str | None = None  # the final path of the file being written

    def __enter__(self) -> OutputFiles:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if error is None:
            self.store.sync()
            return
        about = self._current or self._staged_data_file() or self.out
        try:
            self.discard()
        except (CheckpointError, OSError):
            pass  # the original failure is the one to report
        cause = _root_cause(error)
        if isinstance(cause, KeyboardInterrupt) and not isinstance(error, KeyboardInterrupt):
            raise KeyboardInterrupt from None  # DCP wraps Ctrl-C in its CheckpointException
        if isinstance(cause, OSError) and _wraps_io(error):
            raise storage_error("write", about, cause) from error

    def _folder(self) -> AbstractContextManager[int]:
        """A descriptor of the output folder (``local_files.open_dir``)."""
        return local_files.open_dir(self.out, [], create=False)

    def path(self, name: str) -> str:
        return os.path.join(self.out, name)

    @contextmanager
    def stream(self, name: str) -> Iterator[BinaryIO]:
        """A binary file object for ``name``, written under its temporary name; renamed to
        ``name`` when the block ends without an error (after ``fsync``)."""
        tmp = name + PARTIAL
        self._current = self.path(name)
        try:
            with self._folder() as dfd:
                stream = local_files.create_stream_at(dfd, tmp)
        except CheckpointError:
            raise
        except OSError as e:
            raise storage_error("create", self.path(tmp), e) from None
        self._temps.append(tmp)
        with stream as f:
            yield f
            f.flush()
            local_files.fsync(f.fileno())
        self._publish(tmp, name)

    def write(self, name: str, data: bytes) -> None:
        """``name`` holding ``data``: written (exclusive, fsynced) under its temporary name, renamed."""
        tmp = name + PARTIAL
        self._current = self.path(name)
        self._temps.append(tmp)
        self.store.write(tmp, [data])
        self._publish(tmp, name)

    def staging(self) -> str:
        """The new folder ``OUT/.unickpt-partial`` for another writer (DCP) to fill."""
        with self._folder() as dfd:
            local_files.make_folder_at(dfd, STAGING, 0o755)
        self._staged = True
        return self.path(STAGING)

    def publish_staged(self, last: str) -> list[str]:
        """Rename every file of the staging folder into ``out`` (``last``, the file that makes the
        output valid, e.g. DCP's ``.metadata``, at the end), then remove the folder."""
        names = [n[len(STAGING) + 1 :] for n in self.store.list(STAGING + "/")]
        for name in sorted(names, key=lambda n: n == last):
            self._current = self.path(name)
            self.store.rename(f"{STAGING}/{name}", name)
            self._final.append(name)
        with self._folder() as dfd:
            local_files.remove_folder_at(dfd, STAGING)
        self._staged = False
        self._current = None
        return names

    def _publish(self, tmp: str, name: str) -> None:
        self.store.rename(tmp, name)
        self._temps.remove(tmp)
        self._final.append(name)
        self._current = None

    def _staged_data_file(self) -> str | None:
        """The final path of the data file the staging folder holds (what a failed DCP write names)."""
        if not self._staged:
            return None
        names = [n[len(STAGING) + 1 :] for n in self.store.list(STAGING + "/")]
        data = [n for n in names if not n.startswith(".metadata")]
        return self.path(data[0]) if data else None

    def discard(self) -> None:
        """Remove every file this object created (temporary or renamed) and its staging folder."""
        staged = self.store.list(STAGING + "/") if self._staged else []
        self.store.delete([*self._temps, *self._final, *staged])
        self._temps.clear()
        self._final.clear()
        if self._staged:
            try:
                with self._folder() as dfd:
                    local_files.remove_folder_at(dfd, STAGING)  # a link or a file there: ENOTDIR, kept
            except OSError:
                pass


def _wraps_io(error: BaseException) -> bool:
    """Whether ``error`` is an I/O failure as the writers raise it: an ``OSError`` (not unickpt's
    own, which names its file already), ``torch.save``'s ``RuntimeError`` around it, or DCP's
    ``CheckpointException`` around either (other errors keep their own words)."""
    if isinstance(error, CheckpointError):
        return False
    return isinstance(error, (OSError, RuntimeError)) or type(error).__name__ == "CheckpointException"


def _root_cause(error: BaseException) -> BaseException | None:
    """The first ``KeyboardInterrupt``, else the first ``OSError``, in ``error``'s chain (its
    ``__cause__`` / ``__context__``, and the rank errors of DCP's ``CheckpointException``)."""
    seen: set[int] = set()
    queue = [error]
    found: list[BaseException] = []
    while queue:
        e = queue.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (KeyboardInterrupt, OSError)):
            found.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            queue += [f[0] for f in failures.values() if isinstance(f, tuple) and f and isinstance(f[0], BaseException)]
        queue += [c for c in (e.__cause__, e.__context__) if c is not None]
    interrupts = [e for e in found if isinstance(e, KeyboardInterrupt)]
    return interrupts[0] if interrupts else (found[0] if found else None)
