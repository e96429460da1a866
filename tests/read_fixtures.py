"""Test metadata: 1-d uint8 tensors in one data file (read-assignment tests)."""

from __future__ import annotations

from unickpt.format.records import Metadata, ShardRecord, TensorRecord, Topology


def one_file_metadata(sizes: list[int]) -> Metadata:
    """Tensors ``t0, t1, ...`` of these sizes, one shard each, in file ``f`` one after the
    other (each at the next 64-byte boundary)."""
    tensors = {}
    pos = 0
    for i, n in enumerate(sizes):
        tensors[f"t{i}"] = TensorRecord(f"t{i}", "uint8", (n,), (ShardRecord((0,), (n,), 0, pos, n),))
        pos += -(-n // 64) * 64
    return Metadata(1, "x", 0.0, Topology("torch", 1), ("f",), tensors)
