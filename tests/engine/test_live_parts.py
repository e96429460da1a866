"""``engine.staging.live_parts`` (the blocking save's zero-copy snapshot): each file's parts are
its entries' bytes with the zero padding between them, and the entry list is in plan order,
also for plans that interleave files (``save_plan`` groups them; hand-made plans may not)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.engine.staging import live_parts
from unickpt.planning.save_plan import RankSavePlan, WriteEntry
from unickpt.planning.specs import SaveItem, ShardSpec


def _reference(items, plan, blobs):
    files: dict[str, bytearray] = {}
    for e in plan.entries:
        data = blobs[e.blob_key] if e.blob_key else items[e.item_index].tensor.numpy().tobytes()
        f = files.setdefault(e.file, bytearray())
        f.extend(bytes(e.byte_offset - len(f)))
        f.extend(data)
    return files


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    files=st.lists(st.sampled_from(["a", "b", "c"]), min_size=12, max_size=12),
    gaps=st.lists(st.integers(0, 130), min_size=12, max_size=12),
    blob_at=st.integers(-1, 11),
)
def test_live_parts_are_the_files_bytes_in_plan_order(sizes, files, gaps, blob_at):
    items = [
        SaveItem(ShardSpec(f"t{i}", "uint8", (n,), (0,), (n,)), torch.arange(n, dtype=torch.uint8))
        for i, n in enumerate(sizes)
    ]
    blobs = {"blob": b"xyz"}
    ends: dict[str, int] = {}
    entries = []
    for i, n in enumerate(sizes):
        f = files[i]
        off = ends.get(f, 0) + gaps[i]
        key = "blob" if i == blob_at else ""
        length = 3 if key else n
        entries.append(WriteEntry(-1 if key else i, f, off, length, key))
        ends[f] = off + length
    plan = RankSavePlan(0, "s", tuple(entries))
    parts, in_order = live_parts(items, plan, blobs)
    want = _reference(items, plan, blobs)
    assert {f: b"".join(bytes(p) for p in ps) for f, ps in parts.items()} == {f: bytes(b) for f, b in want.items()}
    assert [bytes(b) for b in in_order] == [
        blobs[e.blob_key] if e.blob_key else items[e.item_index].tensor.numpy().tobytes() for e in plan.entries
    ]
