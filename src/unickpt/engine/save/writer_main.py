"""The writer process's side (``SaveOptions(writer="process")``): write data files from
shared-memory images, fsync them and return their chunk checksums.

``writer_process.WriterProcess`` starts it with ``BOOTSTRAP``: the interpreter registers the
parent packages of the modules it needs without running their ``__init__`` (so neither torch nor
the rest of unickpt is imported: it starts in a fraction of a second), then calls ``main`` with
its end of a Unix socket. It says ``ready``, then serves one ``write`` request at a time
(``writer_messages``): maps the images whose descriptors came with the request (kept until the
parent says ``forget``), writes each file with ``LocalStorage.write`` (exclusive create, no link
followed, O_DIRECT for large files, fsync) and checksums it alongside (``format.checksums``), in
``threads`` threads, and replies ``written`` with the checksums or ``failed`` with the error. It
runs at a lower CPU priority (nice +10, like the save worker thread) and exits at ``exit`` or
when the socket closes (its checkpointer closed, or its process died).
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...format.checksums import chunk_crcs
from ...storage.local import LocalStorage
from ...storage.options import StorageOptions
from ...storage.retry import RetryingStorage
from .writer_messages import MessageError, encode_message, read_message

__all__ = ["BOOTSTRAP", "main", "MAX_FDS"]

MAX_FDS = 256  # file descriptors one request may carry (new images: at most one per data file)

BOOTSTRAP = """\
import os, sys, types
root = sys.argv[1]
for name in ("unickpt", "unickpt.format", "unickpt.engine", "unickpt.engine.save"):
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.join(root, *name.split(".")[1:])]
    sys.modules[name] = pkg
from unickpt.engine.save.writer_main import main
sys.exit(main(sys.argv[2:]))
"""


class _Channel:
    """The socket, with the descriptors that arrived on it not yet claimed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fds: list[int] = []

    def read_exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, n - len(buf), MAX_FDS)
            self.fds.extend(fds)
            if not data:
                if buf:
                    raise MessageError(f"the stream ended after {len(buf)} of {n} bytes")
                return None
            buf += data
        return bytes(buf)

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(encode_message(message))


def main(argv: list[str]) -> int:
    """Serve requests on the socket whose descriptor is ``argv[0]`` until ``exit`` or its end."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
    except (AttributeError, OSError):
        pass
    chan = _Channel(socket.socket(fileno=int(argv[0])))
    images: dict[int, mmap.mmap] = {}
    chan.send({"op": "ready", "pid": os.getpid()})
    while True:
        msg = read_message(chan.read_exact)
        if msg is None or msg["op"] == "exit":
            return 0
        if msg["op"] != "write":
            raise MessageError(f"unknown request {msg['op']!r}")
        new, fds = msg["new_images"], chan.fds[: len(msg["new_images"])]
        del chan.fds[: len(new)]
        if len(fds) != len(new):
            raise MessageError(f"a request names {len(new)} new images but carries {len(fds)} descriptors")
        for image_id, fd in zip(new, fds):
            try:
                images[int(image_id)] = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        for image_id in msg["forget"]:
            old = images.pop(int(image_id), None)
            if old is not None:
                old.close()
        try:
            sums = _write(msg, images)
        except Exception as e:  # reported to the parent, which fails the save on every rank
            errno = getattr(e, "errno", None)
            error = {"type": type(e).__name__, "errno": errno if isinstance(errno, int) else None, "message": str(e)}
            chan.send({"op": "failed", "id": msg["id"], "error": error})
        else:
            chan.send({"op": "written", "id": msg["id"], "sums": sums})


def _write(msg: dict[str, Any], images: dict[int, mmap.mmap]) -> dict[str, list[Any]]:
    """Write and checksum every file of one request (in parallel); its checksums by file."""
    storage = RetryingStorage(LocalStorage(msg["root"], StorageOptions(direct_writes=bool(msg["direct"]))))
    chunk = int(msg["chunk"])
    views: dict[str, memoryview] = {}
    sums: dict[str, list[Any]] = {}
    try:
        for f in msg["files"]:
            size, image = int(f["size"]), f["image"]
            if image is None:
                if size:
                    raise MessageError(f"{f['path']}: {size} bytes but no image")
                views[f["file"]] = memoryview(b"")
                continue
            mm = images.get(int(image))
            if mm is None or len(mm) < size:
                raise MessageError(f"{f['path']}: image {image} is not mapped or smaller than {size} bytes")
            views[f["file"]] = memoryview(mm)[:size]

        def write(f: dict[str, Any]) -> None:
            view = views[f["file"]]
            storage.write(f["path"], [view] if len(view) else [])

        def checksum(f: dict[str, Any]) -> None:
            view = views[f["file"]]
            sums[f["file"]] = [len(view), chunk_crcs([view], chunk)]

        jobs = [(fn, f) for f in msg["files"] for fn in (write, checksum)]
        with ThreadPoolExecutor(max(1, min(int(msg["threads"]), len(jobs)))) as pool:
            for fut in [pool.submit(fn, f) for fn, f in jobs]:
                fut.result()
        return sums
    finally:
        for v in views.values():
            v.release()


if __name__ == "__main__":  # pragma: no cover - started through BOOTSTRAP
    sys.exit(main(sys.argv[1:]))
