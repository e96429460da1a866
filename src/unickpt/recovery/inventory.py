"""One host's RAM tier on disk: where primaries, replicas and commit markers live; what it holds.

Layout under the host's RAM root ``R`` (the fast root resolved on this host, e.g.
``$UNICKPT_SHM_ROOT/unickpt-<uid>/job1``):

* ``R/step_N/...``: the primary copy, written by the ordinary save of this host's ranks (their
  data files; on rank 0's host also the metadata);
* ``R/replicas/<origin host>/step_N/<name>``: the copies of other hosts' files (and, on every host
  but rank 0's, of the metadata), written by ``replicate``;
* ``R/recovery/commit-step_N.json``: this host's commit marker, written by its agent after the
  collective that found every copy of step N written and checksummed on every host. It lists what
  this host holds of that save: name, origin host, where (``primary``/``replica``), size and the
  CRC32C of every chunk. A step without a marker here is not offered by this host.

Called by ``replicate`` (``write_marker``, ``drop_old_steps``), ``restore`` (``held_files``) and
the agent of each host in ``load_latest`` (``local_inventory``). A marker that does not parse or
names a file outside the layout is ignored with a warning, never deleted; only files named by a
marker of ours (and that marker) are ever deleted. Below the root every folder is opened without
following a link (``storage.local_files``, as ``LocalStorage`` does): markers are never read, files
never created, stat'ed or deleted through a link planted where a folder belongs (``drop_step``
leaves the names under such a link alone; ``create`` raises ``UnsafePathError``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import warnings
from collections.abc import Iterator
from typing import Any

from ..errors import StorageError, UnsafePathError
from ..format.checksums import crc32c
from ..storage.local import LocalStorage
from ..storage.local_files import (
    create_at,
    link_at,
    open_dir,
    open_regular,
    rename_at,
    stat_in,
    unlink_at,
    write_all,
)

__all__ = ["RamLayout", "MARKER_FORMAT", "safe_host", "read_chunks", "chunk_crcs_of"]

MARKER_FORMAT = "unickpt-ram-commit/1"
_MARKER_LIMIT = 64 << 20
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_STEP = re.compile(r"^step_[0-9]+$")


def safe_host(host: str) -> str:
    """A host id as a folder name: itself when plain, else ``x`` + its UTF-8 in hex."""
    return host if _SAFE.match(host) and host not in (".", "..") else "x" + host.encode().hex()


def _check_rel(name: str) -> str:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a relative checkpoint file name: {name!r}")
    return name


def read_chunks(layout: RamLayout, path: str, size: int, chunk: int) -> Iterator[bytes]:
    """The file at ``path`` (under ``layout``'s root) in ``chunk``-byte pieces (bounded: one
    chunk at a time); a short read ends early (the caller's CRC or size check fails)."""
    fd = layout.open_read(path)
    try:
        for at in range(0, size, chunk):
            data = os.pread(fd, min(chunk, size - at), at)
            yield data
            if len(data) < min(chunk, size - at):
                return
    finally:
        os.close(fd)


def chunk_crcs_of(layout: RamLayout, path: str, size: int, chunk: int) -> list[int]:
    return [crc32c(c) for c in read_chunks(layout, path, size, chunk)]


class RamLayout:
    """Paths and file operations of one host's RAM root (module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def step_dir(self, stepdir: str) -> str:
        return os.path.join(self.root, stepdir)

    def primary(self, stepdir: str, name: str) -> str:
        return os.path.join(self.root, stepdir, _check_rel(name))

    def replica(self, origin: str, stepdir: str, name: str) -> str:
        return os.path.join(self.root, "replicas", safe_host(origin), stepdir, _check_rel(name))

    def marker(self, stepdir: str) -> str:
        return os.path.join(self.root, "recovery", f"commit-{stepdir}.json")

    def path_of(self, entry: dict[str, Any], stepdir: str) -> str:
        return os.path.join(self.root, *self.rel_of(entry, stepdir).split("/"))

    def rel_of(self, entry: dict[str, Any], stepdir: str) -> str:
        """``entry``'s file relative to the root, '/'-separated."""
        if entry["where"] == "primary":
            return f"{stepdir}/{_check_rel(entry['name'])}"
        return f"replicas/{safe_host(entry['origin'])}/{stepdir}/{_check_rel(entry['name'])}"

    # -------------------------------------------------------------- writing

    def _parts(self, path: str) -> list[str]:
        """``path`` (a path this layout made) as the names below the root."""
        parts = os.path.relpath(path, self.root).split(os.sep)
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{path} is not below the RAM root {self.root}")
        return parts

    def create(self, path: str) -> int:
        """A new file at ``path`` under the root (folders 0700, file 0600, never through a link:
        ``UnsafePathError`` for a link where a folder belongs); an old ``.unickpt-part`` of ours at
        that name is replaced."""
        parts = self._parts(path)
        with open_dir(self.root, parts[:-1], create=True, mode=0o700) as dfd:
            try:
                return create_at(dfd, parts[-1], 0o600)
            except FileExistsError:
                if not path.endswith(".unickpt-part"):
                    raise StorageError(
                        errno.EEXIST, f"{path} exists already: the RAM tier never overwrites a file it did not stage"
                    ) from None
                unlink_at(dfd, parts[-1])
                return create_at(dfd, parts[-1], 0o600)

    def open_read(self, path: str) -> int:
        """A read descriptor of the regular file ``path`` under the root, no folder on the way
        and not the file itself followed through a link (``UnsafePathError``)."""
        return open_regular(self.root, self._parts(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def exists(self, path: str) -> bool:
        """Whether a name ``path`` is there (a link counts; nothing is followed)."""
        try:
            stat_in(self.root, self._parts(path))
        except OSError:  # UnsafePathError included
            return False
        return True

    def unlink(self, path: str) -> None:
        """Remove the name ``path`` (a link is removed, not followed); gone already is fine."""
        parts = self._parts(path)
        try:
            with open_dir(self.root, parts[:-1], create=False) as dfd:
                unlink_at(dfd, parts[-1], missing_ok=True)
        except FileNotFoundError:
            pass

    def link(self, path: str, part: str) -> bool:
        """Give the file ``path`` the second name ``part`` (a ``.unickpt-part`` of ours; a stale
        one is replaced; its folders made), no folder followed; False where the file system has
        no hard links (the caller copies instead)."""
        src, dst = self._parts(path), self._parts(part)
        if not part.endswith(".unickpt-part"):
            raise ValueError(f"{part}: only a .unickpt-part is placed by a link")
        with (
            open_dir(self.root, src[:-1], create=False) as sfd,
            open_dir(self.root, dst[:-1], create=True, mode=0o700) as dfd,
        ):
            unlink_at(dfd, dst[-1], missing_ok=True)
            try:
                link_at(sfd, src[-1], dfd, dst[-1])
            except OSError as e:
                if e.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    return False
                raise
        return True

    def finish_part(self, path: str, keep: bool = True) -> None:
        """Rename ``path + '.unickpt-part'`` (made by ``create``) to ``path`` (``keep``), or remove
        it, in its folder opened without following a link (``open_dir``: ``UnsafePathError`` for a
        link planted where a folder belongs since the part was made): never through a link."""
        parts = self._parts(path)
        with open_dir(self.root, parts[:-1], create=False) as dfd:
            if keep:
                rename_at(dfd, parts[-1] + ".unickpt-part", dfd, parts[-1])
            else:
                unlink_at(dfd, parts[-1] + ".unickpt-part")

    def write_marker(self, stepdir: str, record: dict[str, Any]) -> None:
        path = self.marker(stepdir)
        fd = self.create(path + ".unickpt-part")
        try:
            write_all(fd, [memoryview(json.dumps(record, separators=(",", ":")).encode())])
        finally:
            os.close(fd)
        self.finish_part(path)

    # -------------------------------------------------------------- reading

    def markers(self) -> dict[str, dict[str, Any]]:
        """``stepdir -> marker record`` of every valid commit marker here (others: a warning)."""
        folder = os.path.join(self.root, "recovery")
        out: dict[str, dict[str, Any]] = {}
        try:
            with open_dir(self.root, ["recovery"], create=False, reading=True) as dfd:
                for base in sorted(os.listdir(dfd)):
                    if not (base.startswith("commit-") and base.endswith(".json")):
                        continue
                    stepdir = base[len("commit-") : -len(".json")]
                    try:
                        out[stepdir] = self._read_marker(dfd, base, stepdir)
                    except (OSError, ValueError, KeyError, TypeError) as e:
                        warnings.warn(
                            f"ignoring {folder}/{base}: not a RAM-tier commit marker of unickpt ({e})", stacklevel=2
                        )
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except UnsafePathError as e:  # a link where the markers' folder belongs: never read through it
            warnings.warn(f"ignoring every RAM-tier commit marker of {self.root}: {e}", stacklevel=2)
            return {}
        return out

    def _read_marker(self, dfd: int, base: str, stepdir: str) -> dict[str, Any]:
        if not _STEP.match(stepdir):
            raise ValueError("not a step folder name")
        fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            raw = os.read(fd, _MARKER_LIMIT + 1)
        finally:
            os.close(fd)
        if len(raw) > _MARKER_LIMIT:
            raise ValueError("too large")
        rec = json.loads(raw)
        if rec.get("format") != MARKER_FORMAT or rec["stepdir"] != stepdir:
            raise ValueError("unknown format")
        int(rec["step"]), str(rec["save_id"]), int(rec["chunk"])
        for e in rec["files"]:
            _check_rel(e["name"])
            if e["where"] not in ("primary", "replica") or not isinstance(e["origin"], str):
                raise ValueError(f"bad entry {e!r}")
            int(e["size"]), [int(c) for c in e["crcs"]]
        for n in rec["required"]:
            _check_rel(n)
        return rec

    def local_inventory(self) -> dict[str, dict[str, Any]]:
        """The committed steps here, each marker's files limited to those present with their
        recorded size (contents are checked chunk by chunk when read, not here)."""
        out = {}
        for stepdir, rec in self.markers().items():
            present = []
            for e in rec["files"]:
                try:
                    st = stat_in(self.root, self.rel_of(e, stepdir).split("/"))
                except OSError:  # missing, or under a link where a folder belongs (UnsafePathError)
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_size == e["size"]:
                    present.append(e)
            out[stepdir] = {**rec, "files": present}
        return out

    # -------------------------------------------------------------- retention

    def drop_step(self, stepdir: str, rec: dict[str, Any]) -> None:
        """Delete the marker of ``stepdir`` (first), then the files it names, then the folders
        left empty (a folder holding anything else stays), each relative to its folder's
        descriptor opened without following a link (``LocalStorage.delete``): a link in a file's
        place is removed, never followed; names under a link where a folder belongs are left
        alone (unickpt did not make the link, nor write what it leads to)."""
        files = LocalStorage(self.root)
        files.delete([f"recovery/commit-{stepdir}.json"])
        files.delete([self.rel_of(e, stepdir) for e in rec["files"]])
