"""Metadata records: the parallelism-agnostic description of one checkpoint (DESIGN.md section 3).

``Metadata`` is what the coordinator writes last (its presence is the commit). For every saved
tensor it holds the basic meta (dtype, global shape) and the map from each shard's box
``(offsets, lengths)`` to its bytes ``(file, byte offset, byte length)``: the
TensorShardToBasicByteMap. How those bytes are verified is ``Metadata.checksums``
(``format.checksums``: CRC32C per file chunk from format version 3, per shard and blob before).
Everything is plain data: the codec turns it into JSON, never pickle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from .checksums import Checksums

__all__ = [
    "FORMAT_VERSION",
    "OLDEST_FORMAT_VERSION",
    "METADATA_FILE",
    "JSONValue",
    "ShardRecord",
    "TensorRecord",
    "BlobRecord",
    "Topology",
    "Metadata",
]

FORMAT_VERSION = 3  # the newest format version this unickpt reads and writes (format.codec)
OLDEST_FORMAT_VERSION = 1  # the oldest it reads; what a save asks for (its chunk checksums raise it to 3)
METADATA_FILE = "unickpt.metadata.json"
DATA_DIR = "data"

JSONValue = Union[None, bool, int, float, str, list["JSONValue"], dict[str, "JSONValue"]]  # noqa: UP007 - recursive alias
Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """One saved box of a tensor and where its raw, row-major bytes live."""

    offsets: Shape
    lengths: Shape
    file_index: int  # index into Metadata.files
    byte_offset: int
    byte_length: int


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """Basic meta of one global tensor plus all of its saved shards (non-overlapping, covering):
    a tuple of records, or a ``format.layouts.SplitShards`` that computes them from a regular
    layout when asked."""

    fqn: str
    dtype: str
    shape: Shape
    shards: Sequence[ShardRecord]


@dataclass(frozen=True, slots=True)
class BlobRecord:
    """An opaque byte range (per-rank extra state, dataloader parts)."""

    key: str
    file_index: int
    byte_offset: int
    byte_length: int


@dataclass(frozen=True, slots=True)
class Topology:
    """How the saving job was parallelised. Informational: loading never needs it."""

    framework: str
    world_size: int
    mesh: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Metadata:
    """The global metadata of one committed checkpoint.

    ``format_version``: on a decoded record, the version of its document; on a record to write,
    the lowest version to write it in (the codec raises it to what the content needs: 2 when
    there are ``sections``). ``sections``: feature sections by name (``format.sections``), each a
    frozen record of the type its registered ``SectionCodec`` names. ``checksums``: how the data
    files' bytes are verified (None only on records built in memory without data, e.g. by planner
    tests: such metadata cannot be encoded)."""

    format_version: int
    save_id: str
    created_unix: float
    topology: Topology
    files: tuple[str, ...]
    tensors: dict[str, TensorRecord]
    objects: dict[str, JSONValue] = field(default_factory=dict)
    blobs: dict[str, BlobRecord] = field(default_factory=dict)
    role: str | None = None
    sections: Mapping[str, object] = field(default_factory=dict)
    checksums: Checksums | None = None

    @property
    def total_tensor_bytes(self) -> int:
        return sum(s.byte_length for t in self.tensors.values() for s in t.shards)


def data_path(save_id: str, name: str) -> str:
    """Where data file ``name`` (a plan's per-(rank, part) name) of save ``save_id`` lives in the
    checkpoint folder."""
    return f"{DATA_DIR}/{save_id}/{name}"
