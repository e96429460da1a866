"""``engine.save.staging.live_parts`` (the blocking save's zero-copy snapshot): each file's parts are
its entries' bytes with the zero padding between them, and the entry list is in plan order,
also for plans that interleave files (``save_plan`` groups them; hand-made plans may not)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.engine.save.staging import live_parts
from unickpt.planning.save import RankSavePlan, WriteEntry
from unickpt.planning.specs import SaveItem, ShardSpec


def _reference(items, plan, blobs):
    files: dict[str, bytearray] = {}
    for e in plan.entries:
        data = blobs[e.blob_key] if e.blob_key else items[e.item_index].tensor.numpy().tobytes()
        f = files.setdefault(e.file, bytearray())
        f.extend(bytes(e.byte_offset - len(f)))
        f.extend(data)
    return files


@settings(max_examples=examples(150), deadline=None)
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


@settings(max_examples=examples(60), deadline=None)
@given(
    specs=st.lists(
        st.tuples(
            st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64]),
            st.lists(st.integers(0, 6), max_size=3),
            st.sampled_from(["plain", "transposed", "conj", "big"]),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_staged_images_hold_every_entry_s_bytes(specs):
    """``StagingPool.stage`` (async saves): small CPU entries copied as bytes, large or odd
    ones (conjugate views) by torch; every entry's region of the file image holds its tensor's
    row-major bytes."""
    from unickpt.engine.save.staging import StagingPool
    from unickpt.format.dtypes import dtype_name

    items, entries, offset = [], [], 0
    for i, (dtype, shape, layout) in enumerate(specs):
        t = torch.arange(max(1, 1 << 17) if layout == "big" else int(torch.tensor(shape).prod()))
        t = t.reshape((-1,) if layout == "big" else tuple(shape)).to(dtype)
        if layout == "transposed" and t.dim() >= 2:
            t = t.transpose(0, 1)
        elif layout == "conj" and dtype == torch.complex64:
            t = (t + 1j).conj()
        n = t.numel() * t.element_size()
        items.append(SaveItem(ShardSpec(f"t{i}", dtype_name(dtype), tuple(t.shape), (0,) * t.dim(), tuple(t.shape)), t))
        entries.append(WriteEntry(i, "f", offset, n))
        offset += -(-n // 64) * 64
    pool = StagingPool()
    try:
        staged = pool.stage(items, RankSavePlan(0, "s", tuple(entries)), {})
        staged.wait_ready()
        image = b"".join(bytes(p) for p in staged.parts["f"])
        for e, it in zip(entries, items):
            want = torch.empty(it.tensor.shape, dtype=it.tensor.dtype).copy_(it.tensor)
            want = want.reshape(-1).view(torch.uint8).numpy().tobytes() if want.numel() else b""
            assert image[e.byte_offset : e.byte_offset + e.byte_length] == want
        staged.release()
    finally:
        pool.close()


def test_issue39_item27_a_stage_failing_after_its_background_copy_started_keeps_the_slot_until_the_copy_ends(
    monkeypatch,
):
    """Issue 39 item 27 (a second look): ``StagingPool.stage`` that fails after handing the
    deferred entries to the snapshot thread (an exception raised between that submit and the
    return, e.g. a ``KeyboardInterrupt`` from an application's own SIGINT handler) must keep its
    slot busy until the copy ended: the next ``stage`` of a free slot may unmap its images
    (``_fit``) under the running copy. The snapshot thread is held busy (an ``Event``), so the
    copy is still queued when ``stage`` fails."""
    import threading

    import pytest

    from unickpt.engine.save import staging

    items = [SaveItem(ShardSpec("t0", "float32", (64,), (0,), (64,)), torch.arange(64, dtype=torch.float32))]
    plan = RankSavePlan(0, "s", (WriteEntry(0, "f", 0, 256),))
    pool = staging.StagingPool(slots=1)
    gate = threading.Event()
    try:
        pool._snapshotter.submit(gate.wait)  # the snapshot thread is busy: the copy waits behind it

        def refuse(*a: object, **kw: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(staging, "StagedFiles", refuse)  # fails right after the copy was submitted
        with pytest.raises(KeyboardInterrupt):
            pool.stage(items, plan, {}, later=lambda item: True)
        assert pool._slots[0].busy, "the slot went back while its snapshot copy was still queued"
    finally:
        gate.set()
        pool._snapshotter.shutdown(wait=True)  # the copy ran: the slot is free again
        assert not pool._slots[0].busy
        pool.close()
