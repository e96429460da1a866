"""On-disk representation: metadata records, the codec with its table of format versions,
metadata sections, validation, safe value encoding.

Modules: ``records`` (what a checkpoint says), ``codec`` (bytes <-> records, dispatching on the
format version to ``v1`` / ``v2`` / ``v3``), ``sections`` (feature sections, format version 2 on),
``layouts`` (tensors split alike over many files, described once), ``checksums`` (CRC32C units of
the data files), ``build`` (a save's metadata from its plan and what every rank wrote),
``validation`` (every check, shared with ``planning``), ``tiling`` (the coverage algorithm),
``values`` / ``dtypes`` / ``npdtype`` (plain values, tensors and dtypes by stable names), ``names``
(the characters a name may hold), ``keymap`` / ``transforms`` (keys renamed and tensors derived
as a checkpoint is read).

``dumps_value`` / ``loads_value`` (``values``: tensors and numpy arrays) are imported on first
access, so that decoding and validating metadata imports neither torch nor numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from .codec import DEFAULT_CODEC, READERS, WRITERS, MetadataCodec, decode_metadata, encode_metadata
from .dtypes import dtype_from_name, dtype_name
from .names import printable
from .records import (
    DATA_DIR,
    FORMAT_VERSION,
    METADATA_FILE,
    OLDEST_FORMAT_VERSION,
    BlobRecord,
    Metadata,
    ShardRecord,
    TensorRecord,
    Topology,
)
from .sections import DEFAULT_SECTIONS, SectionCodec, SectionRegistry, SectionWarning
from .validation import validate_metadata

if TYPE_CHECKING:
    from .values import dumps_value, loads_value

__all__ = [
    "DATA_DIR",
    "FORMAT_VERSION",
    "OLDEST_FORMAT_VERSION",
    "METADATA_FILE",
    "BlobRecord",
    "Metadata",
    "ShardRecord",
    "TensorRecord",
    "Topology",
    "DEFAULT_CODEC",
    "READERS",
    "WRITERS",
    "MetadataCodec",
    "decode_metadata",
    "encode_metadata",
    "DEFAULT_SECTIONS",
    "SectionCodec",
    "SectionRegistry",
    "SectionWarning",
    "validate_metadata",
    "dtype_from_name",
    "dtype_name",
    "dumps_value",
    "loads_value",
    "printable",
]


__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(("dumps_value", "loads_value"), ".values"))
