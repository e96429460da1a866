"""Read-assignment test fixtures: small metadata (a split tensor over two files; 1-d uint8
tensors in one data file). The rule the coordinator's columnar assignment is checked against is
in src: ``planning.load.assign.plain_parts`` / ``plain_batches``."""

from __future__ import annotations

from unickpt.format.layouts import SplitLayout, SplitShards
from unickpt.format.records import Metadata, ShardRecord, TensorRecord, Topology


def split_metadata() -> Metadata:
    """One 8 x 2 float32 tensor ``a`` split in two parts over files ``f0`` and ``f1``."""
    lay = SplitLayout((0, 1), (("a", 4, (8, 2), 0),))
    tensors = {"a": TensorRecord("a", "float32", (8, 2), SplitShards(lay, 0))}
    return Metadata(3, "s", 1.0, Topology("fsdp2", 2), ("f0", "f1"), tensors)


def one_file_metadata(sizes: list[int]) -> Metadata:
    """Tensors ``t0, t1, ...`` of these sizes, one shard each, in file ``f`` one after the
    other (each at the next 64-byte boundary)."""
    tensors = {}
    pos = 0
    for i, n in enumerate(sizes):
        tensors[f"t{i}"] = TensorRecord(f"t{i}", "uint8", (n,), (ShardRecord((0,), (n,), 0, pos, n),))
        pos += -(-n // 64) * 64
    return Metadata(1, "x", 0.0, Topology("torch", 1), ("f",), tensors)
