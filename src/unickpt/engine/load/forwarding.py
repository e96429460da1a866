"""Forwarding during a load: the batches a rank reads for other ranks, sent the moment they are
verified, and the batches it receives.

``engine.load.stage.read_stage`` creates a ``Transfer`` after the read assignment (when some batch has
consumers besides its reader): it posts every receive first; ``outgoing(batch)`` gives the buffer
a batch is read into and the callback its shards call as each is verified (the last one sends the
batch, from the reader thread, while other reads go on); ``finish`` sends what is left (after a
failure the batch goes out marked bad, so no receiver waits for it) and waits for every transfer;
only then does the stage agree on success (no collective runs while transfers are in flight);
``apply`` places the received batches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ...coordination.base import Coordinator
from ...errors import ChecksumMismatchError
from ...planning.load.assign import ReadBatch

__all__ = ["Transfer"]

_HEADER = 64  # a forwarded batch starts with this many status bytes: byte 0 is 1 once its payload is verified


class Outgoing:
    """A batch this rank reads for other ranks too: the buffer it is read into and sent from."""

    def __init__(self, batch: ReadBatch) -> None:
        self.batch = batch
        self.buf = torch.zeros(_HEADER + batch.nbytes, dtype=torch.uint8)
        self.left = len(batch.keys)
        self.sent = False


class Transfer:
    """The forwarding of one read stage (``read_stage``): receives posted first, each outgoing
    batch sent by the reader thread that verified its last shard, everything completed in
    ``finish`` (before the stage's agreement, so no collective runs while transfers are in
    flight), received batches placed by ``apply``."""

    def __init__(self, coord: Coordinator, me: int, batches: list[ReadBatch]) -> None:
        self.coord, self.me = coord, me
        self._lock = threading.Lock()
        self._out: list[Outgoing] = []
        self._works: list[Any] = []
        self.received: list[tuple[ReadBatch, torch.Tensor, Any]] = []
        for b in batches:
            if b.reader != me and me in b.consumers:
                buf = torch.empty(_HEADER + b.nbytes, dtype=torch.uint8)
                self.received.append((b, buf, coord.irecv(buf, b.reader, b.batch_id)))

    def outgoing(self, batch: ReadBatch) -> tuple[torch.Tensor, Callable[[], None]]:
        """The buffer to read ``batch`` into (its payload), and what to call as each of its
        shards is verified and placed here (the last call sends the batch)."""
        out = Outgoing(batch)
        self._out.append(out)

        def shard_done() -> None:
            with self._lock:
                out.left -= 1
                if out.left == 0:
                    out.buf[0] = 1
                    self._send(out)

        return out.buf[_HEADER:], shard_done

    def _send(self, out: Outgoing) -> None:  # under the lock
        out.sent = True
        b = out.batch
        self._works += [self.coord.isend(out.buf, dst, b.batch_id) for dst in b.consumers if dst != self.me]

    def finish(self) -> None:
        """Send every batch not sent yet (its header says whether it is good), then wait for
        every send and receive; the first failure is raised after all have completed."""
        with self._lock:
            for out in self._out:
                if not out.sent:
                    self._send(out)
        failure: Exception | None = None
        for work in [*self._works, *(w for _, _, w in self.received)]:
            try:
                work.wait()
            except Exception as e:
                failure = failure or e
        if failure is not None:
            raise failure

    def apply(self, place: Callable[[ReadBatch, torch.Tensor], None]) -> int:
        """``place(batch, payload)`` for every received batch, once the stage agreed that every
        reader succeeded; returns the bytes received."""
        total = 0
        for b, buf, _ in self.received:
            if int(buf[0]) != 1:
                raise ChecksumMismatchError(
                    f"rank {self.me}: batch {b.batch_id} from rank {b.reader} arrived without its verified mark"
                )
            total += b.nbytes
            place(b, buf[_HEADER:])
        return total
