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
marker of ours (and that marker) are ever deleted.
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

from ..errors import StorageError

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


def read_chunks(path: str, size: int, chunk: int) -> Iterator[bytes]:
    """The file at ``path`` in ``chunk``-byte pieces (bounded: one chunk at a time); a short
    read ends early (the caller's CRC or size check fails)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        for at in range(0, size, chunk):
            data = os.pread(fd, min(chunk, size - at), at)
            yield data
            if len(data) < min(chunk, size - at):
                return
    finally:
        os.close(fd)


def crc(data: Any) -> int:
    """The CRC32C of a buffer (bytes, memoryview, numpy array)."""
    import crc32c

    return int(crc32c.crc32c(data))


def chunk_crcs_of(path: str, size: int, chunk: int) -> list[int]:
    return [crc(c) for c in read_chunks(path, size, chunk)]


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
        if entry["where"] == "primary":
            return self.primary(stepdir, entry["name"])
        return self.replica(entry["origin"], stepdir, entry["name"])

    # -------------------------------------------------------------- writing

    def create(self, path: str) -> int:
        """A new file at ``path`` (folders 0700, file 0600, never through a link); an old
        ``.unickpt-part`` of ours at that name is replaced."""
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            if not path.endswith(".unickpt-part"):
                raise StorageError(
                    errno.EEXIST, f"{path} exists already: the RAM tier never overwrites a file it did not stage"
                ) from None
            os.unlink(path)
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)

    def write_marker(self, stepdir: str, record: dict[str, Any]) -> None:
        path = self.marker(stepdir)
        part = path + ".unickpt-part"
        fd = self.create(part)
        try:
            os.write(fd, json.dumps(record, separators=(",", ":")).encode())
        finally:
            os.close(fd)
        os.replace(part, path)

    # -------------------------------------------------------------- reading

    def markers(self) -> dict[str, dict[str, Any]]:
        """``stepdir -> marker record`` of every valid commit marker here (others: a warning)."""
        folder = os.path.join(self.root, "recovery")
        try:
            names = sorted(os.listdir(folder))
        except FileNotFoundError:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for base in names:
            if not (base.startswith("commit-") and base.endswith(".json")):
                continue
            stepdir = base[len("commit-") : -len(".json")]
            try:
                rec = self._read_marker(os.path.join(folder, base), stepdir)
            except (OSError, ValueError, KeyError, TypeError) as e:
                warnings.warn(f"ignoring {folder}/{base}: not a RAM-tier commit marker of unickpt ({e})", stacklevel=2)
                continue
            out[stepdir] = rec
        return out

    def _read_marker(self, path: str, stepdir: str) -> dict[str, Any]:
        if not _STEP.match(stepdir):
            raise ValueError("not a step folder name")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
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
                    st = os.lstat(self.path_of(e, stepdir))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_size == e["size"]:
                    present.append(e)
            out[stepdir] = {**rec, "files": present}
        return out

    # -------------------------------------------------------------- retention

    def drop_step(self, stepdir: str, rec: dict[str, Any]) -> None:
        """Delete the marker of ``stepdir`` (first), then the files it names, then the folders
        left empty (``rmdir``: a folder holding anything else stays)."""
        os.unlink(self.marker(stepdir))
        folders = set()
        for e in rec["files"]:
            path = self.path_of(e, stepdir)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            folders.add(os.path.dirname(path))
        for leaf in sorted(folders, key=len, reverse=True):
            stop = os.path.join(self.root, "replicas") if "/replicas/" in leaf else self.root
            here = leaf
            while here.startswith(stop + "/"):
                try:
                    os.rmdir(here)
                except OSError:
                    break
                here = os.path.dirname(here)
