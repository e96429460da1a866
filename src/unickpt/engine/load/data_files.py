"""The data files a read will touch, checked before anything is allocated from the metadata's
claims: each file holding a shard of the given tensors exists and holds the bytes the metadata
assigns to it. Stats only.

Called before a tensor of a saved shape is allocated: by the load's resize of plain tensors
(``engine.load.resize``) and by the tools that read tensors whole or piece by piece
(``ops.merge``, ``ops.modify``, ``ops.diff``, ``ops.inspect``, through ``ops.pieces``).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from ...errors import MissingDataFileError, TruncatedDataFileError
from ...format import Metadata
from ...format.names import printable
from ...storage import Storage

__all__ = ["check_data_files"]


def check_data_files(
    storage: Storage, md: Metadata, keys: Iterable[str], threads: int = 16, *, prefix: str = "", purpose: str = ""
) -> None:
    """Every data file holding a shard of ``keys`` exists and holds the bytes the metadata
    assigns to it (at least its recorded size, from format version 3). Raises
    MissingDataFileError / TruncatedDataFileError naming the file and a tensor it holds;
    ``prefix`` starts the message (``"rank 3: "``), ``purpose`` follows the tensor's name."""
    need: dict[int, tuple[int, str]] = {}  # file index -> (end of its last range, a tensor there)
    for key in keys:
        for s in md.tensors[key].shards:
            end = s.byte_offset + s.byte_length
            if s.byte_length and end > need.get(s.file_index, (-1, ""))[0]:
                need[s.file_index] = (end, key)
    if not need:
        return
    order = sorted(need)
    with ThreadPoolExecutor(max(1, min(threads, len(order))), thread_name_prefix="unickpt-stat") as pool:
        sizes = dict(zip(order, pool.map(lambda f: storage.size(md.files[f]), order)))
    sums = md.checksums
    for f in order:
        end, key = need[f]
        where = f"{storage.url}/{printable(md.files[f])}"
        holding = f"holding '{printable(key)}'{purpose}"
        size = sizes[f]
        if size is None:
            raise MissingDataFileError(f"{prefix}data file {where} ({holding}) is missing")
        recorded = sums.file_size(f) if sums is not None else None
        want = max(end, recorded or 0)
        if size < want:
            raise TruncatedDataFileError(
                f"{prefix}data file {where} has {size} bytes, the metadata "
                f"{'records' if recorded is not None and recorded >= end else 'needs'} {want} "
                f"({holding}): truncated, or the metadata claims more than was saved"
            )
