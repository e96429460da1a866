"""The reader threads of a load (``engine.load.schedule.read_pieces``) and a cold load through
them end to end, single process.

On local files each file is read front to back by one thread at a time (several files side by
side), its pieces verified on verifier threads while the reader reads on (a bounded backlog);
elsewhere one pool reads all pieces. A failure stops every reader at its next piece and is
raised only once no reader is still writing. End to end (``unickpt.load`` of a model + Adam from
local files): every byte lands bit for bit straight in the live tensors (no copies into place),
the load's phase records count the bytes read and verified, and a flipped byte raises
``ChecksumMismatchError`` (with ``stage_before_apply`` the live tensors are left untouched)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import unickpt
from tests.support.compare import same_state
from unickpt.engine.load.schedule import read_pieces
from unickpt.errors import ChecksumMismatchError, IntegrityError
from unickpt.options import LoadOptions, ReadOptions


class _Job:
    """A run of file ``name`` with the given pieces; records each read (file, offset, thread)
    and how many readers were inside this file at once."""

    def __init__(self, name: str, pieces: list[tuple[int, int]], log: list, active: dict, lock: threading.Lock):
        self.name, self._pieces, self.log, self.active, self.lock = name, pieces, log, active, lock
        self.started = False
        self.fail_at: int | None = None
        self.gate: tuple[threading.Event, threading.Event] | None = None  # (entered, release)

    def start(self) -> None:
        self.started = True

    def pieces(self) -> list[tuple[int, int]]:
        return list(self._pieces)

    def read_piece(self, p: int) -> None:
        with self.lock:
            self.active[self.name] = self.active.get(self.name, 0) + 1
            self.active["max:" + self.name] = max(self.active.get("max:" + self.name, 0), self.active[self.name])
        try:
            if self.gate is not None and p == 0:
                entered, release = self.gate
                entered.set()
                assert release.wait(30)  # held until the other reader's failure is raised
            if p == self.fail_at:
                raise OSError(f"bad piece {self.name}:{p}")
            with self.lock:
                self.log.append((self.name, self._pieces[p][0], threading.current_thread().name))
        finally:
            with self.lock:
                self.active[self.name] -= 1


def _jobs(layout: dict[str, list[list[tuple[int, int]]]]):
    log: list = []
    active: dict = {}
    lock = threading.Lock()
    jobs = [_Job(name, pieces, log, active, lock) for name, runs in layout.items() for pieces in runs]
    return jobs, log, active


LAYOUT = {  # two runs of "a" (given out of file order), one of "b", one of "c"
    "a": [[(64, 80), (80, 96)], [(0, 16), (16, 32), (32, 40)]],
    "b": [[(0, 10), (10, 20), (20, 30), (30, 33)]],
    "c": [[(5, 9)]],
}


@pytest.mark.parametrize("threads", [1, 2, 4, 8])
def test_streams_read_each_file_in_order_by_one_thread_at_a_time(threads: int) -> None:
    jobs, log, active = _jobs(LAYOUT)
    spans: dict[str, list[float]] = {}
    read_pieces(jobs, threads, spans, streams=True)
    assert all(j.started for j in jobs)
    for name, runs in LAYOUT.items():
        want = sorted(lo for pieces in runs for lo, _ in pieces)
        mine = [(lo, t) for f, lo, t in log if f == name]
        assert [lo for lo, _ in mine] == want  # every piece once, in file order
        assert len({t for _, t in mine}) == 1  # one thread read the whole file
        assert active["max:" + name] == 1
        assert spans[name][2] == sum(hi - lo for pieces in runs for lo, hi in pieces)
    assert len({t for _, _, t in log}) <= min(threads, len(LAYOUT))


def test_pool_reads_every_piece_once() -> None:
    jobs, log, _ = _jobs(LAYOUT)
    spans: dict[str, list[float]] = {}
    read_pieces(jobs, 3, spans, streams=False)
    got = sorted((f, lo) for f, lo, _ in log)
    assert got == sorted((name, lo) for name, runs in LAYOUT.items() for pieces in runs for lo, _ in pieces)


def test_a_failure_stops_the_readers_at_their_next_piece() -> None:
    """One reader: the failing file's later pieces and the files after it are never read."""
    jobs, log, _ = _jobs({"a": [[(0, 8), (8, 16), (16, 24)]], "b": [[(0, 4)]]})
    jobs[0].fail_at = 1
    with pytest.raises(OSError, match="bad piece a:1"):
        read_pieces(jobs, 1, {}, streams=True)
    assert [(f, lo) for f, lo, _ in log] == [("a", 0)]


def test_a_failure_is_raised_only_after_every_reader_stopped() -> None:
    """Two readers: "b"'s reader is inside its first piece when "a" fails; ``read_pieces``
    returns (raising) only after that piece finished, and "b"'s later pieces are not read.

    "b" is let go only once the scheduler has noted "a"'s failure (its ``failed`` appended it: a
    profile hook on the read threads sees that ``append`` return), so that "b" reaching its next
    piece before the failure was noted (a race of the test, not of the scheduler) cannot happen."""
    jobs, log, active = _jobs({"a": [[(0, 8), (8, 16)]], "b": [[(0, 4), (4, 8)]]})
    entered, release = threading.Event(), threading.Event()
    jobs[1].gate = (entered, release)
    a_read = jobs[0].read_piece

    def fail_once_b_is_inside(p: int) -> None:  # "a" fails while "b" is mid-piece
        assert entered.wait(30)
        a_read(p)

    def noted(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "c_return" and frame.f_code.co_name == "failed" and getattr(arg, "__name__", "") == "append":
            release.set()

    jobs[0].read_piece = fail_once_b_is_inside  # type: ignore[method-assign]
    jobs[0].fail_at = 0
    threading.setprofile(noted)  # the read threads read_pieces starts
    try:
        with pytest.raises(OSError, match="bad piece a:0"):
            read_pieces(jobs, 2, {}, streams=True)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    assert release.is_set()  # the failure was noted while "b" was inside its piece
    assert active["b"] == 0  # nobody is still reading
    assert ("b", 4) not in [(f, lo) for f, lo, _ in log]


# ------------------------------------------------------------------ end to end, local files


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 768), torch.nn.Linear(768, 640, bias=False))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 512)).square().mean().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    for i, s in state["optimizer"].state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def _data_files(path: Path) -> list[Path]:
    return sorted(p for p in (path / "data").rglob("*.bin") if p.stat().st_size > 0)


def test_cold_load_lands_bit_exact_in_place_and_records_its_phases(tmp_path: Path) -> None:
    saved = _state(0)
    unickpt.save(str(tmp_path / "ck"), saved, framework="torch")
    want = _tensors(saved)
    live = _state(1)  # other values, same layout: every destination exists (read straight into it)
    assert not same_state(_tensors(live), want, bits=True)
    events: list = []
    bus = unickpt.default_checkpointer().events
    bus.add_listener(events.append)
    try:
        unickpt.load(str(tmp_path / "ck"), live, framework="torch", options=LoadOptions(io=ReadOptions(threads=3)))
    finally:
        bus.remove_listener(events.append)
    assert same_state(_tensors(live), want, bits=True)
    by = {e.phase: e for e in events}
    data_bytes = sum(p.stat().st_size for p in _data_files(tmp_path / "ck"))
    assert by["load.read.io"].nbytes == by["load.read"].nbytes == data_bytes
    assert by["load.checksum"].nbytes == data_bytes  # every byte read is verified
    assert float(by["load.checksum"].detail.split(maxsplit=1)[0]) >= 0
    assert "load.describe" in by
    small = sum(t.numel() * t.element_size() for t in want.values() if t.numel() * t.element_size() < 256 << 10)
    assert by["load.copy"].nbytes <= small  # only small tensors (biases, steps) are copied into place


@pytest.mark.parametrize("staged", [False, True])
def test_a_flipped_byte_fails_the_cold_load(tmp_path: Path, staged: bool) -> None:
    saved = _state(0)
    unickpt.save(str(tmp_path / "ck"), saved, framework="torch")
    victim = max(_data_files(tmp_path / "ck"), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) * 2 // 3] ^= 0x10
    victim.write_bytes(bytes(raw))
    live = _state(1)
    before = _tensors(live)
    with pytest.raises(ChecksumMismatchError) as caught:
        unickpt.load(str(tmp_path / "ck"), live, framework="torch", options=LoadOptions(stage_before_apply=staged))
    assert isinstance(caught.value, IntegrityError)
    if staged:  # verified before anything live is touched
        assert same_state(_tensors(live), before, bits=True)
        assert "partially overwritten" not in str(caught.value)
    else:  # read straight into the live tensors: the error says so
        assert "partially overwritten" in str(caught.value)


def test_one_reader_per_file_only_where_the_kernel_reads_ahead(tmp_path: Path) -> None:
    """Local files through the page cache: streams; O_DIRECT reads (no readahead) and storage
    without a page cache (every read a round trip): one pool over all pieces."""
    from unickpt.storage import open_storage
    from unickpt.storage.memory import MemoryStorage, MemoryStore
    from unickpt.storage.options import StorageOptions

    def reads_ahead(storage) -> bool:
        return storage.capabilities.reads_ahead

    assert reads_ahead(open_storage(str(tmp_path), StorageOptions(direct_reads=False)))
    assert not reads_ahead(open_storage(str(tmp_path), StorageOptions(direct_reads=True)))
    assert not reads_ahead(MemoryStorage("x", store=MemoryStore()))


# ------------------------------------------------------------------ reads apart from their verification


class _SplitJob(_Job):
    """A ``SplitJob``: ``read_bytes`` logs the read; ``settle`` logs the piece settled, on which
    thread, and how many pieces were read and not yet settled at the time; ``bad`` pieces fail
    their settling (a checksum mismatch)."""

    def __init__(self, *args, gate: threading.Event | None = None) -> None:
        super().__init__(*args)
        self.settled: list[tuple[int, str]] = []
        self.bad: set[int] = set()
        self.unsettled = {"now": 0, "max": 0}
        self.hold = gate  # settling waits for it (the readers run ahead meanwhile)

    def read_piece(self, p: int) -> None:  # never called on a split job in streams order
        raise AssertionError("read_piece called on a split job")

    def read_bytes(self, p: int) -> None:
        with self.lock:
            self.log.append((self.name, self._pieces[p][0], threading.current_thread().name))
            self.unsettled["now"] += 1
            self.unsettled["max"] = max(self.unsettled["max"], self.unsettled["now"])

    def settle(self, p: int) -> None:
        if self.hold is not None:
            assert self.hold.wait(30)
        with self.lock:
            self.unsettled["now"] -= 1
            self.settled.append((p, threading.current_thread().name))
        if p in self.bad:
            raise ChecksumMismatchError(f"checksum mismatch in {self.name} piece {p}")


def _split_jobs(layout: dict[str, list[list[tuple[int, int]]]]) -> list[_SplitJob]:
    log: list = []
    active: dict = {}
    lock = threading.Lock()
    return [_SplitJob(name, pieces, log, active, lock) for name, runs in layout.items() for pieces in runs]


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_split_jobs_are_read_by_the_readers_and_every_piece_settled_by_verifiers(threads: int) -> None:
    jobs = _split_jobs(LAYOUT)
    spans: dict[str, list[float]] = {}
    read_pieces(jobs, threads, spans, streams=True)
    log = jobs[0].log
    for name, runs in LAYOUT.items():
        want = sorted(lo for pieces in runs for lo, _ in pieces)
        assert [lo for f, lo, _ in log if f == name] == want  # still read in file order, each once
        assert spans[name][2] == sum(hi - lo for pieces in runs for lo, hi in pieces)
    for job in jobs:  # every piece settled once before read_pieces returned, on a verifier thread
        assert sorted(p for p, _ in job.settled) == list(range(len(job.pieces())))
        assert all(t.startswith("unickpt-verify") for _, t in job.settled)


def test_readers_run_ahead_of_verification_by_a_bounded_backlog() -> None:
    """Settling is held: the one reader reads on until ``BACKLOG`` pieces wait for their
    verification, and no further; once released, everything is settled."""
    from unickpt.engine.load import schedule

    release = threading.Event()
    job = _SplitJob("a", [(i * 8, i * 8 + 8) for i in range(10)], [], {}, threading.Lock(), gate=release)
    done = threading.Thread(target=read_pieces, args=([job], 1, {}, True))
    done.start()
    while len(job.log) < schedule.BACKLOG:  # the reader fills the backlog without any settling
        done.join(0.01)
    done.join(0.2)  # a reader that ignored the bound would read all 10 pieces meanwhile
    assert len(job.log) == schedule.BACKLOG
    release.set()
    done.join(30)
    assert not done.is_alive()
    assert job.unsettled == {"now": 0, "max": schedule.BACKLOG}
    assert sorted(p for p, _ in job.settled) == list(range(10))


def test_a_failed_verification_stops_the_readers_and_is_raised_after_all_stopped() -> None:
    """Piece 1 of "a" fails its checksum: the error is raised (the same error object), the
    readers stop at their next piece (not every later piece of "a" is read) and no verifier is
    still running when ``read_pieces`` returns."""
    jobs = _split_jobs({"a": [[(i * 8, i * 8 + 8) for i in range(40)]], "b": [[(0, 4), (4, 8)]]})
    jobs[0].bad = {1}
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch in a piece 1"):
        read_pieces(jobs, 2, {}, streams=True)
    settled_at_return = [list(j.settled) for j in jobs]
    assert len([f for f, _, _ in jobs[0].log if f == "a"]) < 40  # stopped early
    assert [list(j.settled) for j in jobs] == settled_at_return  # nothing settles after the return
