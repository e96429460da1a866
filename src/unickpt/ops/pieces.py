"""Read one tensor of a checkpoint in pieces of bounded size, in row-major order, and check the
data files before allocating anything the metadata claims.

Order of use (``merge``, ``diff``, ``inspect --values``; ``modify`` and ``merge
--format torch`` call ``check_data_files`` only, then ``merge.read_full_tensor``):
  1. ``check_data_files(storage, md, keys)`` stats every data file holding a shard of ``keys``
     (one ``size`` call each, in parallel): a missing file, or one shorter than its recorded
     size or than the bytes the metadata assigns to it, is refused here, so a metadata that
     claims more data than the files hold (a forged 8 GiB shape) allocates nothing;
  2. ``iter_pieces(md, storage, fqn)`` yields the tensor as consecutive pieces: ``slabs`` cuts
     the shape into boxes contiguous in row-major order of at most ``PIECE_BYTES`` each (at
     least one element), and each box is read through the load engine (``planning.
     load.overlap.plan_local_load`` + ``engine.load.stage.read_stage``: ranged reads of the saved shards
     it overlaps, CRC32C verified) into one reusable buffer. Concatenating the pieces' bytes
     gives the tensor's bytes.

Memory bound: the piece buffer (``PIECE_BYTES``) plus what the read engine holds for one piece:
the rows of each saved shard the piece touches (a row is one index of the shard's first
dimension) and the checksum chunks around them. For a piece cut along the first dimension that
is the piece's own size again; a saved shard whose single row is larger than a piece (a
``[1, N]`` tensor of N elements larger than a piece) is read a whole row at a time.

Checkpoints of format versions 1 and 2 hold one checksum per saved shard, not per file chunk:
verifying any part of a shard means reading all of it. For a tensor larger than a piece there,
``iter_pieces`` first checks every shard's checksum by streaming its bytes through one buffer of
at most a piece (``_check_shard_units``), then reads the pieces without checking again: memory
stays bounded, and each byte is read twice instead of a whole shard per piece.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..coordination.single import SingleProcessCoordinator
from ..engine.load.data_files import check_data_files
from ..errors import CheckpointError, ChecksumMismatchError, ConfigurationError
from ..format import Metadata, dtype_from_name
from ..format.checksums import ChunkChecksums
from ..storage import Storage
from .printable import quoted

if TYPE_CHECKING:
    import torch

    from ..planning.load.shards import ShardIndex

__all__ = ["PIECE_BYTES", "slabs", "check_data_files", "iter_pieces"]

PIECE_BYTES = 64 << 20  # the largest piece of a tensor held at once (merge, diff, inspect --values)
_ONE = SingleProcessCoordinator()

Box = tuple[tuple[int, ...], tuple[int, ...]]


def slabs(shape: tuple[int, ...], itemsize: int, piece_bytes: int = PIECE_BYTES) -> Iterator[Box]:
    """Boxes ``(offsets, lengths)`` that tile ``shape`` in row-major order, each contiguous in
    the tensor's row-major bytes and at most ``piece_bytes`` (at least one element). The
    boxes fix the indices of the leading dimensions, take a range of one dimension ``d`` and
    all of the dimensions after it (``d`` is the first dimension whose trailing block fits)."""
    nd = len(shape)
    if nd == 0 or math.prod(shape) == 0:
        yield (0,) * nd, tuple(shape)
        return
    inner, d = itemsize, nd - 1  # inner: bytes of one index of dimension d (all of d+1.. inside)
    while d > 0 and inner * shape[d] <= piece_bytes:
        inner *= shape[d]
        d -= 1
    step = max(1, piece_bytes // inner)
    tail = tuple(shape[d + 1 :])
    for lead in itertools.product(*(range(n) for n in shape[:d])):
        for start in range(0, shape[d], step):
            n = min(step, shape[d] - start)
            yield (*lead, start, *(0,) * len(tail)), (*(1,) * d, n, *tail)


def iter_pieces(
    md: Metadata,
    storage: Storage,
    fqn: str,
    *,
    threads: int = 4,
    piece_bytes: int = PIECE_BYTES,
    index: ShardIndex | None = None,
) -> Iterator[torch.Tensor]:
    """The tensor ``fqn`` as consecutive pieces (``slabs``), each a tensor of the box's shape in
    the tensor's dtype. A piece is a view of one reusable buffer: valid until the next one is
    asked for (copy it to keep it). ``index``: a ShardIndex of ``md`` to share across tensors."""
    import torch  # the tensor readers import torch, the file checks do not

    from ..engine.load.stage import read_stage
    from ..planning.load.overlap import plan_local_load
    from ..planning.load.shards import ShardIndex
    from ..planning.specs import LoadItem, ShardSpec

    rec = md.tensors.get(fqn)
    if rec is None:
        raise ConfigurationError(f"{storage.url} has no tensor {quoted(fqn)}")
    dtype = dtype_from_name(rec.dtype)
    shape = tuple(rec.shape)
    index = index if index is not None else ShardIndex(md)
    numel = math.prod(shape)
    verify = True
    if (
        md.checksums is not None
        and not isinstance(md.checksums, ChunkChecksums)
        and numel * dtype.itemsize > piece_bytes
    ):
        _check_shard_units(md, storage, fqn, piece_bytes)  # per-shard checksums: checked once, streamed
        verify = False
    buffer = torch.empty(max(1, min(numel, max(1, piece_bytes // dtype.itemsize))), dtype=dtype)
    for offsets, lengths in slabs(shape, dtype.itemsize, piece_bytes):
        n = math.prod(lengths)
        piece = buffer[:n].view(lengths)
        if n:
            spec = ShardSpec(fqn, rec.dtype, shape, offsets, lengths)
            reads = plan_local_load(md, [spec], index)
            read_stage(
                md,
                storage,
                coord=_ONE,
                items=[LoadItem(spec, piece)],
                reads=reads,
                threads=threads,
                verify=verify,
                dedup=False,
            )
        yield piece


def _check_shard_units(md: Metadata, storage: Storage, fqn: str, buffer_bytes: int) -> None:
    """Check the checksum units (format versions 1 and 2: one per saved shard) covering the
    shards of ``fqn``, each streamed through one buffer of at most ``buffer_bytes``
    (``verify._check_units``, which reports ``"<ErrorType>: <message>"``); raises that error
    (ChecksumMismatchError, or the read's: TruncatedDataFileError ...) for the first bad one."""
    from .. import errors
    from .verify import _check_units, _Held

    assert md.checksums is not None
    problems: list[str] = []
    for s in md.tensors[fqn].shards:
        if not s.byte_length:
            continue
        lo, hi = s.byte_offset, s.byte_offset + s.byte_length
        units = md.checksums.cover(s.file_index, lo, hi)
        held = [_Held(lo, hi, f"{quoted(fqn)} shard offsets={s.offsets} lengths={s.lengths}", False)]
        _check_units(storage, md.files[s.file_index], units, buffer_bytes, lambda a, b, m: problems.append(m), held)
        if problems:
            name, _, message = problems[0].partition(": ")
            cls = getattr(errors, name, None)
            if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
                cls, message = ChecksumMismatchError, problems[0]
            raise cls(message)
