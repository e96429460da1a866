"""``TokenPackingLoader``: packs tokens of several weighted sources into fixed-length sequences,
deterministically, with state that reshards across data-parallel sizes without losing or
repeating a token.

Data: ``sources`` maps a name to ``.npy`` files of 1-D integer tokens (documents concatenated);
a source's token stream is its files in order. Each stream is cut into blocks of
``block_tokens`` tokens, and the blocks are dealt to ``num_parts`` parts round-robin (block ``b``
belongs to part ``b % num_parts``). ``num_parts`` is fixed for a dataset (default 64) and must be
at least the DP size; DP rank ``r`` of ``n`` owns the parts ``p % n == r``.

A part produces one sequence at a time: it draws a source with probability proportional to
``weights`` among those it has not exhausted (``numpy`` generator seeded by ``(seed, part,
sequence number)``), moves that source's next block of the part into its token buffer, and
emits the first ``seq_len`` tokens of the buffer; the rest of a block stays in the buffer for the
next sequence (also across batches and checkpoints). When a part's blocks of a source are used
up, that source starts its next epoch for the part; with ``epochs=k`` it is exhausted after k.
A rank fills a batch of ``batch_size`` rows from its parts, always asking the part with the
fewest sequences so far (ties: the lowest part number). When every owned part is exhausted, a
last, partly filled buffer is padded with ``pad_id``.

Equal batches per rank (``even_batches=True``, the default): with ``epochs`` set, the DP ranks'
parts hold different numbers of sequences, and a rank that ran out first would leave the others
waiting in the training step's collective. Every rank therefore returns the same number of
batches, all full: ``min`` over the DP ranks of ``floor(rows left / batch_size)``, computed from
the file lengths and the parts' sequence counts alone (no collective; ``_batches_left``), and the
rows left over at the end of the data (fewer than ``batch_size`` on the rank with the fewest,
a few more on the others) are dropped. A resume (any DP size) recomputes it from the saved counts:
no sequence is repeated, and only the end of the data is dropped. ``even_batches=False``: each
rank runs to the end of its own parts (every token once; the last batch may have fewer rows and
the ranks stop at different steps).

The state is tiny: per part, per source its epoch and next block, the buffer as token ranges
(``[source, start, end)``), the number of sequences and the exhausted sources; the replicated
state names the dataset (sources, file lengths, weights, sizes, seed), checked on load.
``num_workers`` threads copy the token ranges of a batch in parallel (the plan of a batch is
made from lengths alone, so the result does not depend on the number of workers); with workers
the next batch is read ahead (``prefetch``) while the current one trains, and the saved state is
always the one after the last batch returned (prepared when that batch was handed out), so a
checkpoint never waits for the readers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..errors import LoaderStateError
from ..state.loader import LoaderState

__all__ = ["TokenPackingLoader"]

_MAX_BUFFER_RANGES = 1 << 16


class _Source:
    def __init__(self, name: str, paths: Sequence[str]) -> None:
        self.name = name
        self.paths = [str(p) for p in paths]
        self.arrays = []
        for p in self.paths:
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise LoaderStateError(
                    f"TokenPackingLoader: {p} must hold a 1-D integer array, got {arr.dtype} {arr.shape}"
                )
            self.arrays.append(arr)
        self.lengths = [int(a.shape[0]) for a in self.arrays]
        self.starts = np.cumsum([0, *self.lengths])
        self.total = int(self.starts[-1])

    def copy_into(self, out: np.ndarray, start: int, end: int) -> None:
        """Tokens [start, end) of the stream into ``out`` (crossing file boundaries)."""
        at = 0
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < end:
            f_end = int(self.starts[i + 1])
            n = min(end, f_end) - start
            off = start - int(self.starts[i])
            out[at : at + n] = self.arrays[i][off : off + n]
            at += n
            start += n
            i += 1


class TokenPackingLoader:
    """See the module docstring. Iterate it for ``[rows, seq_len]`` LongTensor batches."""

    def __init__(
        self,
        sources: Mapping[str, Sequence[str]],
        weights: Mapping[str, float],
        seq_len: int,
        batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 0,
        num_workers: int = 0,
        epochs: int | None = None,
        pad_id: int = 0,
        num_parts: int = 64,
        block_tokens: int = 2048,
        prefetch: bool = True,
        even_batches: bool = True,
    ) -> None:
        if set(sources) != set(weights) or not sources:
            raise ValueError("TokenPackingLoader: sources and weights must name the same, non-empty set of sources")
        if any(not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0) for w in weights.values()):
            raise ValueError(f"TokenPackingLoader: weights must be positive finite numbers, got {dict(weights)}")
        for what, v in (("seq_len", seq_len), ("batch_size", batch_size), ("dp_size", dp_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"TokenPackingLoader: {what} must be an int >= 1, got {v!r}")
        if not (isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
            raise ValueError(f"TokenPackingLoader: dp_rank {dp_rank!r} must be in [0, {dp_size})")
        if not (isinstance(num_parts, int) and num_parts >= dp_size):
            raise LoaderStateError(
                f"TokenPackingLoader: num_parts {num_parts} is smaller than dp_size {dp_size}: some DP ranks "
                "would get no data; choose num_parts >= the largest DP size the job will ever use"
            )
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"TokenPackingLoader: epochs must be None or an int >= 1, got {epochs!r}")
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"TokenPackingLoader: block_tokens must be an int >= 1, got {block_tokens!r}")
        self.names = sorted(sources)
        self.sources = [_Source(n, sources[n]) for n in self.names]
        self.weights = np.array([float(weights[n]) for n in self.names])
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.num_workers, self.epochs, self.pad_id = seed, num_workers, epochs, pad_id
        self.num_parts, self.block_tokens = num_parts, block_tokens
        self._parts: dict[int, dict[str, Any]] = {p: self._fresh_part() for p in self._owned()}
        self.even_batches = even_batches
        # batches this rank still returns (None: to the end of its parts): see the module docstring
        self._batches_left = self._even_batches_left({p: 0 for p in range(num_parts)})
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="unickpt-loader") if num_workers > 0 else None
        # prefetch (num_workers > 0): the next batch is planned and read while the current one
        # trains; the checkpointed state stays the state after the last *returned* batch, so a
        # save never waits for the readers and never skips the prefetched batch
        self.prefetch = prefetch
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="unickpt-prefetch") if num_workers > 0 else None
        self._ahead: Future[torch.Tensor] | None = None
        self._consumed: dict[int, dict[str, Any]] = {p: _copy_part(st) for p, st in self._parts.items()}

    # ------------------------------------------------------------------ layout

    def _owned(self) -> list[int]:
        return [p for p in range(self.num_parts) if p % self.dp_size == self.dp_rank]

    def _fresh_part(self) -> dict[str, Any]:
        return {"cursor": [[0, 0] for _ in self.sources], "buffer": [], "count": 0, "exhausted": []}

    def _blocks_of(self, s: int, part: int) -> int:
        """How many blocks of source ``s`` part ``part`` has."""
        nblocks = -(-self.sources[s].total // self.block_tokens)
        return max(0, -(-(nblocks - part) // self.num_parts))

    def _sequences_of(self, part: int) -> int:
        """How many sequences ``part`` yields over all ``epochs`` (``epochs`` set): its tokens per
        epoch (its blocks, the last block of a source shorter) packed ``seq_len`` at a time, the
        last one padded."""
        assert self.epochs is not None
        tokens = 0
        for s, src in enumerate(self.sources):
            nblocks = -(-src.total // self.block_tokens)
            tokens += self._blocks_of(s, part) * self.block_tokens
            if nblocks and (nblocks - 1) % self.num_parts == part:  # the source's last, short block
                tokens -= nblocks * self.block_tokens - src.total
        return -(-(tokens * self.epochs) // self.seq_len)

    def _even_batches_left(self, counts: Mapping[int, int]) -> int | None:
        """With ``even_batches`` and ``epochs``: the full batches every DP rank can still return,
        given every part's sequences so far (``counts``, part -> count); None otherwise."""
        if not self.even_batches or self.epochs is None:
            return None
        rows = [0] * self.dp_size
        for p in range(self.num_parts):
            rows[p % self.dp_size] += max(0, self._sequences_of(p) - int(counts.get(p, 0)))
        return min(rows) // self.batch_size

    # ------------------------------------------------------------------ planning (lengths only)

    def _next_sequence(self, part: int) -> list[tuple[int, int, int]] | None:
        """Advance ``part`` by one sequence; its token ranges (None: the part is exhausted)."""
        st = self._parts[part]
        buf: list[list[int]] = st["buffer"]
        have = sum(e - b for _, b, e in buf)
        while have < self.seq_len:
            live = [s for s in range(len(self.sources)) if s not in st["exhausted"] and self._blocks_of(s, part) > 0]
            if not live:
                break
            rng = np.random.default_rng([self.seed, part, st["count"], have])
            w = self.weights[live]
            s = live[int(rng.choice(len(live), p=w / w.sum()))]
            cur = st["cursor"][s]
            k = cur[1]
            block = part + k * self.num_parts
            start = block * self.block_tokens
            end = min(start + self.block_tokens, self.sources[s].total)
            buf.append([s, start, end])
            have += end - start
            cur[1] += 1
            if cur[1] >= self._blocks_of(s, part):  # this part's blocks of s used up: next epoch
                cur[0] += 1
                cur[1] = 0
                if self.epochs is not None and cur[0] >= self.epochs:
                    st["exhausted"].append(s)
        if have == 0:
            return None
        out: list[tuple[int, int, int]] = []
        need = self.seq_len
        while need > 0 and buf:
            s, b, e = buf[0]
            n = min(need, e - b)
            out.append((s, b, b + n))
            need -= n
            if b + n == e:
                buf.pop(0)
            else:
                buf[0][1] = b + n
        st["count"] += 1
        return out

    def _plan_batch(self) -> list[list[tuple[int, int, int]]]:
        rows: list[list[tuple[int, int, int]]] = []
        done: set[int] = set()
        while len(rows) < self.batch_size:
            candidates = [p for p in self._parts if p not in done]
            if not candidates:
                break
            part = min(candidates, key=lambda p: (self._parts[p]["count"], p))
            row = self._next_sequence(part)
            if row is None:
                done.add(part)
            else:
                rows.append(row)
        return rows

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def _start_batch(self) -> Future[torch.Tensor] | None:
        """Plan the next batch (advancing the parts) and start reading it on the workers."""
        if self._batches_left is not None:
            if self._batches_left <= 0:
                return None  # the end of the data for every rank at once (even_batches)
            self._batches_left -= 1
        rows = self._plan_batch()
        if not rows:
            return None
        out = np.full((len(rows), self.seq_len), self.pad_id, dtype=np.int64)

        def fill(i: int) -> None:
            at = 0
            for s, b, e in rows[i]:
                self.sources[s].copy_into(out[i, at : at + e - b], b, e)
                at += e - b

        def read_all() -> torch.Tensor:
            if self._pool is not None:
                list(self._pool.map(fill, range(len(rows))))
            else:
                for i in range(len(rows)):
                    fill(i)
            return torch.from_numpy(out)

        if self._reader is None:
            done: Future[torch.Tensor] = Future()
            done.set_result(read_all())
            return done
        return self._reader.submit(read_all)

    def __next__(self) -> torch.Tensor:
        pending = self._ahead if self._ahead is not None else self._start_batch()
        self._ahead = None
        if pending is None:
            raise StopIteration
        batch = pending.result()
        # the state after this batch: what a checkpoint taken now must resume from
        self._consumed = {p: _copy_part(st) for p, st in self._parts.items()}
        if self._reader is not None and self.prefetch:
            self._ahead = self._start_batch()  # read the next batch while this one trains
        return batch

    def close(self) -> None:
        self._ahead = None
        for pool in (self._reader, self._pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._reader = self._pool = None

    # ------------------------------------------------------------------ unickpt.data protocol

    def _replicated(self) -> dict[str, Any]:
        return {
            "sources": {s.name: list(s.paths) for s in self.sources},
            "lengths": {s.name: list(s.lengths) for s in self.sources},
            "weights": {n: float(w) for n, w in zip(self.names, self.weights)},
            "seq_len": self.seq_len,
            "seed": self.seed,
            "epochs": self.epochs,
            "num_parts": self.num_parts,
            "block_tokens": self.block_tokens,
        }

    def unickpt_state(self) -> LoaderState:
        parts = {p: _copy_part(st) for p, st in self._consumed.items()}
        return LoaderState(self.dp_rank, self.dp_size, self.num_parts, self._replicated(), parts)

    def load_unickpt_state(
        self, replicated: Mapping[str, Any], parts: Mapping[int, Mapping[str, Any]], saved_dp_size: int
    ) -> None:
        mine = self._replicated()
        for key in ("lengths", "weights", "seq_len", "seed", "epochs", "num_parts", "block_tokens"):
            if replicated.get(key) != mine[key]:
                raise LoaderStateError(
                    f"TokenPackingLoader: the checkpoint's loader was built with {key}={replicated.get(key)!r}, "
                    f"this one with {mine[key]!r}: resuming would not continue the same data order"
                )
        new = {}
        for p in self._owned():
            if p not in parts:
                raise LoaderStateError(
                    f"TokenPackingLoader: the checkpoint lacks part {p} (saved by {saved_dp_size} DP ranks)"
                )
            new[p] = self._checked_part(p, parts[p])
        counts = {}
        if self.even_batches and self.epochs is not None:  # every rank's rows left: every part's count
            for p in range(self.num_parts):
                if p not in parts:
                    raise LoaderStateError(
                        f"TokenPackingLoader: the checkpoint lacks part {p} (saved by {saved_dp_size} DP ranks)"
                    )
                counts[p] = new[p]["count"] if p in new else self._checked_part(p, parts[p])["count"]
        self._ahead = None  # a batch prefetched from the old position is dropped
        self._parts = new
        self._batches_left = self._even_batches_left(counts)
        self._consumed = {p: _copy_part(st) for p, st in new.items()}

    def _checked_part(self, p: int, raw: Mapping[str, Any]) -> dict[str, Any]:
        try:
            cursor = [[int(e), int(k)] for e, k in raw["cursor"]]
            buffer = [[int(s), int(b), int(e)] for s, b, e in raw["buffer"]]
            count = int(raw["count"])
            exhausted = [int(s) for s in raw["exhausted"]]
        except (KeyError, TypeError, ValueError) as e:
            raise LoaderStateError(f"TokenPackingLoader: part {p} of the checkpoint is malformed: {e}") from e
        n = len(self.sources)
        ok = (
            len(cursor) == n
            and all(0 <= k <= self._blocks_of(s, p) and e >= 0 for s, (e, k) in enumerate(cursor))
            and len(buffer) <= _MAX_BUFFER_RANGES
            and all(0 <= s < n and 0 <= b <= e <= self.sources[s].total for s, b, e in buffer)
            and count >= 0
            and all(0 <= s < n for s in exhausted)
        )
        if not ok:
            raise LoaderStateError(f"TokenPackingLoader: part {p} of the checkpoint does not fit this dataset")
        return {"cursor": cursor, "buffer": buffer, "count": count, "exhausted": exhausted}


def _copy_part(st: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "cursor": [list(c) for c in st["cursor"]],
        "buffer": [list(r) for r in st["buffer"]],
        "count": st["count"],
        "exhausted": list(st["exhausted"]),
    }
