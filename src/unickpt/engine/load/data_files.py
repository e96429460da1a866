"""The data files a read will touch, checked before anything is allocated from the metadata's
claims: each file holding a shard of the given tensors exists and holds the bytes the metadata
assigns to it. Stats only.

Called before a tensor of a saved shape is allocated: by the load's resize of plain tensors
(``engine.load.resize``) and by the tools that read tensors whole or piece by piece
(``ops.merge``, ``ops.modify``, ``ops.diff``, ``ops.inspect``, through ``ops.pieces``).
"""

from __future__ import annotations

from collections.abc import Iterable

from ...folder.files import data_files, raise_problem
from ...format import Metadata
from ...format.names import printable
from ...storage import Storage

__all__ = ["check_data_files"]


def check_data_files(
    storage: Storage, md: Metadata, keys: Iterable[str], threads: int = 16, *, prefix: str = "", purpose: str = ""
) -> None:
    """Every data file holding a shard of ``keys`` is complete (``folder.files``: a regular file
    of at least its expected size). Raises MissingDataFileError / TruncatedDataFileError naming
    the file and a tensor it holds; ``prefix`` starts the message (``"rank 3: "``), ``purpose``
    follows the tensor's name."""
    holding: dict[int, str] = {}  # file index -> a tensor there
    for key in keys:
        for s in md.tensors[key].shards:
            if s.byte_length:
                holding.setdefault(s.file_index, f"'{printable(key)}'{purpose}")
    if holding:
        found = data_files(storage, md, indices=sorted(holding), threads=threads)
        raise_problem(found, md, storage.url, prefix, holding)
