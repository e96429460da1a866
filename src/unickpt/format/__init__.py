"""On-disk representation: metadata records, codec with version dispatch, safe value encoding."""

from .codec import decode_metadata, encode_metadata
from .dtypes import dtype_from_name, dtype_name
from .records import (
    DATA_DIR,
    FORMAT_VERSION,
    METADATA_FILE,
    BlobRecord,
    Metadata,
    ShardRecord,
    TensorRecord,
    Topology,
)
from .values import dumps_value, loads_value

__all__ = [
    "DATA_DIR",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "BlobRecord",
    "Metadata",
    "ShardRecord",
    "TensorRecord",
    "Topology",
    "decode_metadata",
    "encode_metadata",
    "dtype_from_name",
    "dtype_name",
    "dumps_value",
    "loads_value",
]
