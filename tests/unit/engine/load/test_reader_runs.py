"""The read engine's runs (``engine.load.reader.RunJob``) against a plain oracle: for random byte
spans of a file, some landing straight in their destination and some in temporaries, pieces read
in any order deliver every need exactly its bytes, exactly once; a flipped byte anywhere in a
chunk is caught by whichever read needs that chunk, and names what the chunk holds, also when
reads are cut small and folded into their units' checksums as they arrive (``fused``, local files),
in file order or not. Needs with a
device destination (``Need.device``, a CUDA region in a real load) run here with CPU "device"
targets through the same bounce-buffer pool (``DeviceCopies(pin=False)``): their bytes arrive
exactly, and never before every checksum unit overlapping them is verified."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.engine.load.device import DeviceCopies
from unickpt.engine.load.reader import Need, RunJob
from unickpt.errors import ChecksumMismatchError
from unickpt.format.checksums import ChunkChecksums, chunk_crcs
from unickpt.planning.load.runs import Span, plan_runs

SETTINGS = settings(max_examples=examples(200), deadline=None, derandomize=True, database=None)


@st.composite
def layouts(draw):
    size = draw(st.integers(0, 700))
    data = bytes(draw(st.lists(st.integers(0, 255), min_size=size, max_size=size)))
    chunk = draw(st.sampled_from([1, 16, 64, 1000]))
    spans, pos = [], 0
    while pos < size and len(spans) < 8:
        pos += draw(st.integers(0, 60))
        n = draw(st.integers(0, 90))
        if pos + n > size:
            break
        lands = draw(st.sampled_from(["direct", "copied", "into", "device"]))
        cuts = sorted(draw(st.lists(st.integers(pos, pos + n), max_size=4)))  # "into": several destinations, gaps
        spans.append((pos, pos + n, lands, list(zip([pos, *cuts], [*cuts, pos + n]))[:: draw(st.sampled_from([1, 2]))]))
        pos += n
    piece = draw(st.sampled_from([7, 64, 1 << 20]))
    fused = draw(st.sampled_from([0, 5, 33]))  # reads of this many bytes, each folded into its units' CRC
    return data, chunk, spans, (piece, fused), draw(st.randoms())


def _run_all(data: bytes, chunk: int, spans, cut: tuple[int, int], rnd, verify: bool = True):
    piece, fused = cut
    sums = ChunkChecksums.from_files(chunk, [(len(data), chunk_crcs([data], chunk))])
    got: dict[int, list[bytes]] = {}
    dests: dict[int, torch.Tensor] = {}
    device = DeviceCopies([], slots=2, slot_bytes=48, pin=False)  # small: pieces also go unpooled
    intos: dict[int, list[tuple[int, bytearray]]] = {}
    needs = []
    for i, (lo, hi, lands, parts) in enumerate(spans):
        dest = torch.zeros(hi - lo, dtype=torch.uint8) if lands == "direct" else None
        if dest is not None:
            dests[i] = dest
        if lands == "into":  # copied by the run itself, no callback: one destination per part
            intos[i] = [(a, bytearray(b - a)) for a, b in parts]
            needs.append(Need("f", lo, hi, None, f"t{i}", None, tuple((a, memoryview(d)) for a, d in intos[i])))
            continue
        record = lambda b, i=i: got.setdefault(i, []).append(bytes(b.numpy()))  # noqa: E731
        if lands == "device":  # bounced to this target; ``done`` only for an empty need
            dests[i] = torch.zeros(hi - lo, dtype=torch.uint8)
            needs.append(Need("f", lo, hi, record, f"t{i}", None, device=dests[i]))
            continue
        needs.append(Need("f", lo, hi, record, f"t{i}", dest))

    def cover(f: int, lo: int, hi: int) -> tuple[int, int]:
        u = sums.cover(f, lo, hi)
        return u.lo, u.hi

    def read_into(name: str, offset: int, out: memoryview) -> None:
        out[:] = data[offset : offset + len(out)]

    runs = plan_runs(
        [Span(0, lo, hi, i) for i, (lo, hi, *_) in enumerate(spans)], cover if verify else lambda f, a, b: (a, b)
    )
    jobs = []
    for run in runs:
        units = sums.cover(0, run.lo, run.hi) if verify else sums.cover(0, 0, 0)
        job = RunJob(
            run,
            "f",
            [needs[t] for t in run.tags],
            units,
            read_into,
            verify,
            "mem://x",
            0,
            None,
            piece,
            device=device,
            fused=fused,
        )
        job.start()
        jobs += [(job, p) for p in range(len(job.pieces()))]
    rnd.shuffle(jobs)  # any order, as the reader pool may run them
    for job, p in jobs:
        job.read_piece(p)
    return got, dests, intos


@SETTINGS
@given(layouts(), st.booleans())
def test_every_need_gets_its_bytes_once_whatever_the_piece_order(case, verify: bool) -> None:
    data, chunk, spans, piece, rnd = case
    got, dests, intos = _run_all(data, chunk, spans, piece, rnd, verify)
    bounced = {i for i, (lo, hi, lands, _) in enumerate(spans) if lands == "device" and hi > lo}
    assert sorted([*got, *intos, *bounced]) == list(range(len(spans)))
    for i, (lo, hi, _lands, _parts) in enumerate(spans):
        if i in bounced:  # copied to its device target piece by piece, ``done`` never called
            assert i not in got and bytes(dests[i].numpy()) == data[lo:hi], i
            continue
        if i in intos:
            for a, d in intos[i]:
                assert bytes(d) == data[a : a + len(d)], i  # copied into its destination by the run
            continue
        assert got[i] == [data[lo:hi]], i  # exactly once, exactly its bytes
        if i in dests and hi > lo:
            assert bytes(dests[i].numpy()) == data[lo:hi]  # landed in place


@SETTINGS
@given(layouts(), st.data())
def test_a_flipped_byte_is_caught_by_any_read_of_its_chunk(case, draw) -> None:
    data, chunk, spans, piece, rnd = case
    spans = [s for s in spans if s[1] > s[0]]
    if not spans:
        return
    lo, hi, *_ = draw.draw(st.sampled_from(spans))
    at = draw.draw(st.integers(lo, hi - 1))
    bad = bytearray(data)
    bad[at] ^= 0x01
    sums_of_good = data  # the checksums were taken of the good bytes

    def run_bad():
        # checksums of the good file, reads of the corrupted one
        return _run_bad(bytes(bad), sums_of_good, chunk, spans, piece, rnd)

    with pytest.raises(ChecksumMismatchError, match=rf"bytes \[{at // chunk * chunk}, "):
        run_bad()


def _run_bad(bad: bytes, good: bytes, chunk: int, spans, cut: tuple[int, int], rnd):
    piece, fused = cut
    sums = ChunkChecksums.from_files(chunk, [(len(good), chunk_crcs([good], chunk))])
    needs = [Need("f", lo, hi, lambda b: None, f"t{i}", None) for i, (lo, hi, *_) in enumerate(spans)]

    def cover(f: int, lo: int, hi: int) -> tuple[int, int]:
        u = sums.cover(f, lo, hi)
        return u.lo, u.hi

    def read_into(name: str, offset: int, out: memoryview) -> None:
        out[:] = bad[offset : offset + len(out)]

    for run in plan_runs([Span(0, lo, hi, i) for i, (lo, hi, *_) in enumerate(spans)], cover):
        job = RunJob(
            run,
            "f",
            [needs[t] for t in run.tags],
            sums.cover(0, run.lo, run.hi),
            read_into,
            True,
            "x",
            0,
            None,
            piece,
            fused=fused,
        )
        order = list(range(len(job.pieces())))
        rnd.shuffle(order)  # out of file order, a unit's folded checksum is dropped and the unit read again
        for p in order:
            job.read_piece(p)


@pytest.mark.parametrize("in_order", [True, False])
def test_fused_reads_fold_each_chunk_as_it_lands_and_check_a_chunk_reached_out_of_order_once(
    in_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 bytes in chunks of 40 ([0, 40), [40, 80), [80, 100)), one need over all of them, pieces
    of 32 bytes, fused reads of 5. In file order every CRC32C call covers one read of at most 5
    bytes (each folded into its chunk as it lands). With the second piece read first, chunk 0 is
    reached at byte 32 before its start: it is checked whole (one call over its 40 bytes) once
    read, while chunks 1 and 2 are still folded. Either way every byte is checksummed once."""
    from unickpt.engine.load import reader

    calls: list[int] = []
    plain = reader.crc32c
    monkeypatch.setattr(reader, "crc32c", lambda b, v=0: calls.append(len(b)) or plain(b, v))
    data = bytes((7 * i) % 256 for i in range(100))
    sums = ChunkChecksums.from_files(40, [(100, chunk_crcs([data], 40))])
    got: list[bytes] = []
    clock = reader.ReadClock()
    job = RunJob(
        plan_runs([Span(0, 0, 100, 0)], lambda f, a, b: (a, b))[0],
        "f",
        [Need("f", 0, 100, lambda b: got.append(bytes(b.numpy())), "t", None)],
        sums.cover(0, 0, 100),
        lambda n, o, out: out.__setitem__(slice(None), data[o : o + len(out)]),
        True,
        "x",
        0,
        None,
        32,
        clock=clock,
        fused=5,
    )
    job.start()
    for p in [0, 1, 2, 3] if in_order else [1, 0, 2, 3]:
        job.read_piece(p)
    assert got == [data]
    assert (clock.io_bytes, clock.checksum_bytes) == (100, 100)
    whole = [n for n in calls if n > 5]
    assert whole == ([] if in_order else [40])
    assert sum(calls) == 100  # chunk 0 out of order: none of its bytes folded, all checked once


def test_checksum_error_names_what_the_chunk_holds() -> None:
    data = bytes(range(200))
    sums = ChunkChecksums.from_files(64, [(200, chunk_crcs([data], 64))])
    bad = bytearray(data)
    bad[70] ^= 0xFF
    need = Need("f", 0, 200, lambda b: None, "model.w", None)
    job = RunJob(
        plan_runs([Span(0, 0, 200, 0)], lambda f, a, b: (a, b))[0],
        "data/x.bin",
        [need],
        sums.cover(0, 0, 200),
        lambda n, o, out: out.__setitem__(slice(None), bad[o : o + len(out)]),
        True,
        "/ck",
        3,
        lambda lo, hi: ["'model.w'", "blob 'extra_state/rank0'"],
    )
    with pytest.raises(ChecksumMismatchError) as info:
        job.read_piece(0)
    msg = str(info.value)
    assert "rank 3" in msg and "/ck/data/x.bin bytes [64, 128)" in msg and "blob 'extra_state/rank0'" in msg


@SETTINGS
@given(st.integers(0, 255), st.sampled_from([16, 40, 64]), st.sampled_from([32, 64, 100]), st.randoms())
def test_device_bytes_arrive_only_after_their_units_are_verified(at: int, chunk: int, piece: int, rnd) -> None:
    """One need bounced to a device target, a flipped byte at ``at``: every piece is read (in
    any order, the failure caught); the target holds nothing (zeros) of a piece overlapping the
    bad chunk's neighbourhood, and of every other piece its exact bytes or nothing (a piece
    completed by the failing one is not copied: the load fails anyway)."""
    data = bytes(range(1, 256)) + b"\x07"  # no zero byte: a zero in the target means "not copied"
    sums = ChunkChecksums.from_files(chunk, [(len(data), chunk_crcs([data], chunk))])
    bad = bytearray(data)
    bad[at] ^= 0x01
    target = torch.zeros(len(data), dtype=torch.uint8)
    need = Need("f", 0, len(data), lambda b: None, "t", None, device=target)
    run = plan_runs([Span(0, 0, len(data), 0)], lambda f, a, b: (a, b))[0]
    device = DeviceCopies([], slots=1, slot_bytes=piece, pin=False)
    job = RunJob(
        run,
        "f",
        [need],
        sums.cover(0, 0, len(data)),
        lambda n, o, out: out.__setitem__(slice(None), bad[o : o + len(out)]),
        True,
        "x",
        0,
        None,
        piece,
        device=device,
    )
    order = list(range(len(job.pieces())))
    rnd.shuffle(order)
    failures = 0
    for p in order:
        try:
            job.read_piece(p)
        except ChecksumMismatchError:
            failures += 1
    assert failures == 1
    bad_lo, bad_hi = at // chunk * chunk, min(len(data), (at // chunk + 1) * chunk)
    got = bytes(target.numpy())
    for lo, hi in job.pieces():
        # a piece's bytes are copied once every chunk overlapping it is verified
        units_lo, units_hi = lo // chunk * chunk, -(-hi // chunk) * chunk
        tainted = units_lo < bad_hi and bad_lo < units_hi
        if tainted:
            assert got[lo:hi] == bytes(hi - lo), (lo, hi)
        else:  # copied, or not when the failure stopped the piece that would have completed it
            assert got[lo:hi] in (data[lo:hi], bytes(hi - lo)), (lo, hi)

    assert device.bounced + device.unpooled == sum(hi - lo for lo, hi in job.pieces()) - got.count(0)


def test_bounce_pool_reuses_its_buffers_and_never_waits_forever() -> None:
    """The pool hands out at most ``slots`` buffers; one more while all are held is plain
    memory (no wait that could not end); a buffer copied out or given back is reused."""
    device = DeviceCopies([], slots=2, slot_bytes=8, pin=False)
    a, b = device.acquire(8), device.acquire(5)
    assert (a.slot, b.slot) == (0, 1) and b.memory.numel() == 5
    c = device.acquire(8)
    assert c.slot == -1  # both held: plain memory
    assert device.acquire(9).slot == -1  # larger than a buffer: plain memory
    a.memory[:] = torch.arange(8, dtype=torch.uint8)
    target = torch.zeros(8, dtype=torch.uint8)
    device.copy(a, target)
    assert target.tolist() == list(range(8)) and device.bounced == 8
    assert device.acquire(3).slot == 0  # copied out: reused
    device.give_back(b)
    assert device.acquire(8).slot == 1
    device.finish()


class _FakeStream:
    def __init__(self) -> None:
        self.waited_on: list[object] = []
        self.synchronized = 0

    def wait_stream(self, other: object) -> None:
        self.waited_on.append(other)

    def synchronize(self) -> None:
        self.synchronized += 1


class _FakeEvent:
    """A CUDA event stand-in: recorded = a copy in flight until ``done`` or ``synchronize``."""

    def __init__(self) -> None:
        self.done, self.waits, self.records = True, 0, 0

    def record(self, stream: object) -> None:
        self.done, self.records = False, self.records + 1

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def test_pinned_pool_reuses_a_buffer_only_after_its_copy_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch of the pool with stand-ins for streams, events and page-locked memory: a
    buffer whose copy is in flight is reused only once its event completed (taken without a
    wait when ``query`` says so, else after ``synchronize``); ``finish`` synchronises the side
    stream and orders the caller's current stream after it; the side stream was ordered after
    the caller's current stream at the start."""
    from unickpt.engine.load import device as device_mod

    current = _FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(device_mod, "_host_buffer", lambda n, pin: (torch.empty(n, dtype=torch.uint8), True))
    cuda0 = torch.device("cuda", 0)
    pool = DeviceCopies([cuda0], slots=2, slot_bytes=8)
    side = pool._streams[cuda0]
    assert side.waited_on == [current]  # pending work on the destinations first
    pool._streams = {torch.device("cpu"): side}  # CPU tensors stand in for the device targets here
    target = torch.zeros(8, dtype=torch.uint8)
    a, b = pool.acquire(8), pool.acquire(8)
    a.memory[:] = 5
    pool.copy(a, target)
    e0 = pool._events[a.slot]
    assert target.tolist() == [5] * 8 and e0.records == 1 and not e0.done
    c = pool.acquire(8)  # none free, the pool full: the oldest copy's buffer, after its event
    assert c.slot == a.slot and e0.waits == 1
    pool.copy(b, target)
    e1 = pool._events[b.slot]
    e1.done = True  # the copy completed by itself: its buffer is taken without a wait
    d = pool.acquire(8)
    assert d.slot == b.slot and e1.waits == 0
    assert pool.acquire(8).slot == -1  # both held by pieces: plain memory, no wait
    pool.finish()
    assert side.synchronized == 1 and current.waited_on == [side]
