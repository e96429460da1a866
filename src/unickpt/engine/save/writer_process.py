"""The writer process of ``SaveOptions(writer="process")``: an async save's files written by a
separate process from shared-memory snapshot images, instead of writer threads in the training
process (where writing and checksumming compete with training for the interpreter and its lock).

Who calls what, in order:
  1. ``StagingPool.stage(..., shared=True)`` (the caller's thread) copies the snapshot into
     ``SharedImage`` file images (memfd-backed, page aligned, MAP_SHARED) and calls
     ``WriterProcess.start`` (spawns the process the first time: it boots while the caller
     trains);
  2. ``SavePipeline.write_and_commit`` (the save worker thread) calls ``WriterProcess.write``:
     one ``write`` request (``writer_messages``) naming each file, its size and its image, with
     the descriptors of images the process has not mapped yet; the process
     (``writer_main``) writes and fsyncs the files and replies with their chunk checksums,
     which go to the commit stage exactly as the threads' do (so the commit still waits for every
     rank's durable files, and a failure still fails the save on every rank);
  3. ``StagingPool.close`` (``Checkpointer.close``, after its saves drained) calls ``close``:
     ``exit``, then waits for the process. At interpreter exit the save worker's drain waits for
     queued saves first, then an ``atexit`` handler stops the process the same way (a parent
     that dies without either: the process sees its socket close and exits).
One process per checkpointer, started once and reused by every async save; one request at a
time (the save worker runs saves in order). A process that died (killed, out of memory) is
reported as ``WriterProcessError`` by the save it was serving (never a hang: its socket closes),
and the next save starts a new one. Linux only (memfd); elsewhere, and for storage other than
plain local files, async saves use the writer threads.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from typing import Any

from ...errors import StorageError, WriterProcessError
from .writer_main import BOOTSTRAP
from .writer_messages import MessageError, encode_message, read_message

__all__ = ["SharedImage", "WriterProcess", "FileToWrite", "supported"]

_IDS = itertools.count(1)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../unickpt


def supported() -> bool:
    """Whether this host can run the writer process (Linux: memfd and descriptor passing)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and sys.platform.startswith("linux")


class SharedImage:
    """A page-aligned, pre-faulted byte buffer in anonymous shared memory (a memfd), which the
    writer process maps by its descriptor: the snapshot reaches it without a copy."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(mmap.PAGESIZE, -(-capacity // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.id = next(_IDS)
        self.fd = os.memfd_create(f"unickpt-image-{self.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.capacity)
            populate = getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(self.fd, self.capacity, flags=mmap.MAP_SHARED | populate)
        except BaseException:
            os.close(self.fd)
            raise
        self._mm: mmap.mmap | None = mm
        self.view = memoryview(mm)

    def close(self) -> None:
        """Close the descriptor; the mapping goes with its last view (``AlignedBuffer.close``:
        a tensor of ``torch.frombuffer`` keeps no buffer export, an explicit unmap would pull the
        pages from under it)."""
        self.view = memoryview(b"")
        self._mm = None
        os.close(self.fd)


FileToWrite = tuple[str, str, int, SharedImage | None]  # (plan file name, storage path, size, image)


class WriterProcess:
    """The client side: starts the process, sends requests, waits for replies, stops it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._mapped: set[int] = set()  # images the running process has mapped
        self._forget: set[int] = set()  # freed images it should unmap at the next request
        self._forget_lock = threading.Lock()  # not ``_lock``: the caller's thread never waits for a write
        self._requests = itertools.count(1)
        self._closed = False
        self._at_exit = False

    @property
    def pid(self) -> int | None:
        """The running process's id (None: not started, or stopped)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Spawn the process unless one runs (it boots in the background; ``write`` waits).
        Returns at once while a request is in flight (the process runs then)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._start()
        finally:
            self._lock.release()

    def _start(self) -> None:
        if self._closed:
            raise WriterProcessError("the writer process was shut down: this checkpointer is closed")
        if self._proc is not None and self._proc.poll() is None:
            return
        self._stop(kill=True)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", BOOTSTRAP, _PACKAGE, str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._sock, self._ready, self._mapped = parent, False, set()
        if not self._at_exit:  # after the save worker's drain (exit_hook): stop it in order
            self._at_exit = True
            atexit.register(_stop_at_exit, weakref.ref(self))

    def forget(self, image: SharedImage) -> None:
        """``image`` is being freed: the process unmaps it at its next request (an id it never
        mapped is ignored there)."""
        with self._forget_lock:
            self._forget.add(image.id)

    def write(
        self, root: str, direct: bool, files: list[FileToWrite], chunk: int, threads: int
    ) -> dict[str, tuple[int, list[int]]]:
        """Have the process write and fsync ``files`` under the local folder ``root`` and return
        each file's (size, chunk CRC32Cs). Raises the process's error (``StorageError`` for a
        storage failure) or ``WriterProcessError`` if it died."""
        with self._lock:
            self._start()
            assert self._sock is not None
            sock = self._sock
            try:
                if not self._ready:
                    hello = self._receive(sock)
                    if hello.get("op") != "ready":
                        raise MessageError(f"expected 'ready', got {hello.get('op')!r}")
                    self._ready = True
                new = [img for img in {id(i): i for _, _, _, i in files if i is not None}.values()]
                new = [img for img in new if img.id not in self._mapped]
                rid = next(self._requests)
                with self._forget_lock:
                    forget, self._forget = self._forget, set()
                request = {
                    "op": "write",
                    "id": rid,
                    "root": root,
                    "direct": direct,
                    "chunk": chunk,
                    "threads": threads,
                    "files": [
                        {"file": f, "path": p, "size": n, "image": i.id if i is not None else None}
                        for f, p, n, i in files
                    ],
                    "new_images": [img.id for img in new],
                    "forget": sorted(forget),
                }
                socket.send_fds(sock, [encode_message(request)], [img.fd for img in new])
                self._mapped.update(img.id for img in new)
                self._mapped.difference_update(forget)
                reply = self._receive(sock)
            except (OSError, MessageError) as e:
                raise self._died(e) from None
            if reply.get("id") != rid:
                raise self._died(MessageError(f"reply to request {reply.get('id')!r}, expected {rid}"))
            if reply["op"] == "failed":
                raise _error_of(reply["error"])
            if reply["op"] != "written":
                raise self._died(MessageError(f"unexpected reply {reply['op']!r}"))
            return {f: (int(s[0]), [int(c) for c in s[1]]) for f, s in reply["sums"].items()}

    def _receive(self, sock: socket.socket) -> dict[str, Any]:
        def read_exact(n: int) -> bytes | None:
            buf = bytearray()
            while len(buf) < n:
                data = sock.recv(n - len(buf))
                if not data:
                    if buf:
                        raise MessageError(f"the writer's stream ended after {len(buf)} of {n} bytes")
                    return None
                buf += data
            return bytes(buf)

        msg = read_message(read_exact)
        if msg is None:
            raise MessageError("the writer process closed its socket")
        return msg

    def _died(self, cause: BaseException) -> WriterProcessError:
        """The error of a process that stopped answering (it is stopped; the next save restarts it)."""
        proc = self._proc
        pid = proc.pid if proc is not None else None
        code = None
        if proc is not None:
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
        self._stop(kill=True)
        if code is not None and code < 0:
            how = f"was killed by signal {-code} ({_signal_name(-code)})"
        elif code is not None:
            how = f"exited with status {code}"
        else:
            how = f"stopped answering ({type(cause).__name__}: {cause})"
        return WriterProcessError(
            f"the async save's writer process (pid {pid}) {how} before the files were durable; "
            "this save is not committed (the previous checkpoint is untouched) and the next save starts a new writer"
        )

    def _stop(self, kill: bool) -> None:
        sock, proc = self._sock, self._proc
        self._sock, self._proc, self._ready = None, None, False
        self._mapped = set()
        with self._forget_lock:
            self._forget = set()
        if sock is not None:
            if not kill:
                try:
                    sock.sendall(encode_message({"op": "exit"}))
                except OSError:
                    pass
            sock.close()
        if proc is not None:
            if not kill:
                try:
                    proc.wait(timeout=60)  # it finishes nothing in flight: ``exit`` comes between requests
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the process (after the checkpointer's saves drained; no request is in flight)."""
        with self._lock:
            self._closed = True
            self._stop(kill=False)


def _stop_at_exit(writer: weakref.ref[WriterProcess]) -> None:
    """At interpreter exit (the saves drained): stop the process if its checkpointer was not closed."""
    w = writer()
    if w is not None:
        try:
            w.close()
        except Exception:  # never break the interpreter's shutdown; the process exits at EOF anyway
            pass


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return "unknown"


def _error_of(error: dict[str, Any]) -> Exception:
    """The parent's exception for the process's ``failed`` reply."""
    kind, errno, message = str(error.get("type")), error.get("errno"), str(error.get("message"))
    if kind.endswith("StorageError") or errno is not None:
        return StorageError(errno if isinstance(errno, int) else 0, f"{message} (in the writer process)")
    return WriterProcessError(f"the writer process failed: {kind}: {message}")
