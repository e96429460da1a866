"""The fake N-rank coordinator (``unickpt.testing.threads``): N ranks as threads of this process,
with the collective semantics unickpt relies on (order-matched collectives, copy semantics,
deadlines naming the missing ranks, point-to-point FIFO per tag). Issue 11: "a fake N-rank
coordinator for unit tests of planning and the stage protocol in one process"."""

from __future__ import annotations

import threading

import pytest
import torch

from unickpt.coordination.base import Coordinator
from unickpt.errors import CheckpointError, CollectiveError, CollectiveTimeoutError
from unickpt.testing.threads import ThreadCoordinator, ThreadExchange, run_threads

WORLD_SIZES = [1, 2, 3, 5]


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_issue11_fake_coordinator_collectives_at_every_world_size(ws):
    def body(c: ThreadCoordinator) -> dict:
        gathered = c.all_gather_object({"rank": c.rank, "sq": c.rank**2})
        at1 = c.gather_object(("from", c.rank), dst=ws - 1)
        got = c.broadcast_object(f"root says {c.rank}" if c.rank == 0 else "ignored", src=0)
        part = c.scatter_object([[r, "x" * r] for r in range(ws)] if c.rank == ws - 1 else None, src=ws - 1)
        c.barrier()
        return {"gathered": gathered, "at1": at1, "got": got, "part": part, "calls": list(c.calls)}

    res = run_threads(body, ws)
    for r, out in enumerate(res):
        assert out["gathered"] == [{"rank": q, "sq": q * q} for q in range(ws)]
        assert out["at1"] == ([("from", q) for q in range(ws)] if r == ws - 1 else None)
        assert out["got"] == "root says 0"
        assert out["part"] == [r, "x" * r]
        assert out["calls"] == ["all_gather_object", "gather_object", "broadcast_object", "scatter_object", "barrier"]


def test_issue11_fake_coordinator_satisfies_the_coordinator_protocol():
    coord: Coordinator = ThreadCoordinator(ThreadExchange(1), 0)  # mypy checks the protocol here
    assert (coord.rank, coord.world_size) == (0, 1)
    assert coord.all_gather_object(7) == [7] and coord.gather_object(8) == [8]
    assert coord.broadcast_object(9) == 9 and coord.scatter_object([10]) == 10


def test_issue11_fake_coordinator_copies_what_it_exchanges():
    """Every rank gets its own copy: mutating what one rank received, or what it sent after the
    collective, never shows on another rank (torch pickles; here deepcopy)."""
    barrier = threading.Barrier(3)

    def body(c: ThreadCoordinator) -> dict:
        mine = {"rank": c.rank, "items": [c.rank]}
        got = c.all_gather_object(mine)
        mine["items"].append("sender changed it")  # after the collective
        got[0]["items"].append(f"rank {c.rank} changed it")  # what it received
        barrier.wait()  # every rank has mutated before anyone looks
        shared = {"tensor": torch.zeros(3)}
        b = c.broadcast_object(shared, src=1)
        if c.rank == 1:
            assert b is shared  # as torch: the source keeps its own object
        else:
            b["tensor"].add_(c.rank + 1)
        barrier.wait()
        return {"got": got, "b": b["tensor"].tolist(), "shared": shared["tensor"].tolist()}

    res = run_threads(body, 3)
    for r, out in enumerate(res):
        assert out["got"][0]["items"] == [0, f"rank {r} changed it"]
        assert [g["items"] for g in out["got"][1:]] == [[1], [2]]
        assert out["b"] == ([0.0, 0.0, 0.0] if r == 1 else [float(r + 1)] * 3)
    assert res[1]["shared"] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("ws", [2, 4])
def test_issue11_fake_coordinator_a_rank_that_never_arrives_is_named_at_the_deadline(ws):
    """A rank stuck elsewhere (not in the collective): the others raise CollectiveTimeoutError
    naming it after the deadline instead of hanging."""
    release = threading.Event()

    def body(c: ThreadCoordinator) -> object:
        if c.rank == ws - 1:
            assert release.wait(30)  # stuck until the others gave up
            return "late"
        try:
            return c.all_gather_object(c.rank)
        finally:
            if c.rank == 0:
                release.set()

    with pytest.raises(CollectiveTimeoutError) as ei:
        run_threads(body, ws, timeout=0.5)
    err = ei.value
    assert isinstance(err, CheckpointError) and isinstance(err, TimeoutError)
    assert err.missing_ranks == (ws - 1,), err.missing_ranks
    assert f"rank(s) [{ws - 1}] did not arrive" in str(err) and "all_gather_object (collective #1)" in str(err)
    assert err.timeout_s == 0.5


def test_issue11_fake_coordinator_a_rank_that_left_fails_the_others_at_once():
    """A rank whose thread ended (raised, like a dead process) before a collective: the ranks
    waiting in it raise CollectiveError naming it, long before the deadline; run_threads
    re-raises the root cause (rank 1's own error) with its rank."""

    class Boom(RuntimeError):
        pass

    seen: dict[int, BaseException] = {}

    def body(c: ThreadCoordinator) -> None:
        c.barrier()
        if c.rank == 1:
            raise Boom("rank 1 failed on its own")
        try:
            c.all_gather_object(c.rank)
        except CollectiveError as e:
            seen[c.rank] = e
            raise

    with pytest.raises(Boom) as ei:
        run_threads(body, 3, timeout=60, limit=30)
    assert "(raised on thread-rank 1 of 3)" in "".join(ei.value.__notes__)
    assert sorted(seen) == [0, 2]
    for e in seen.values():
        assert not isinstance(e, CollectiveTimeoutError)
        assert isinstance(e, CollectiveError) and 1 in e.missing_ranks
        assert "rank 1 raised Boom after 1 collective(s)" in str(e)


def test_issue11_fake_coordinator_refuses_ranks_calling_different_collectives():
    def body(c: ThreadCoordinator) -> object:
        return c.barrier() if c.rank == 1 else c.all_gather_object(c.rank)

    with pytest.raises(CollectiveError, match="different collectives at #1") as ei:
        run_threads(body, 3, timeout=10)
    msg = str(ei.value)
    assert "barrier on rank" in msg and "all_gather_object on rank" in msg, msg

    def wrong_root(c: ThreadCoordinator) -> object:
        return c.broadcast_object("x", src=c.rank)

    with pytest.raises(CollectiveError, match=r"broadcast_object\(root 0\)"):
        run_threads(wrong_root, 2, timeout=10)


def test_issue11_fake_coordinator_point_to_point_is_fifo_per_tag():
    def body(c: ThreadCoordinator) -> list[list[int]]:
        if c.rank == 0:
            sends = [c.isend(torch.tensor([i, i + 1], dtype=torch.uint8), dst=1, tag=7) for i in (1, 3, 5)]
            sends.append(c.isend(torch.tensor([9, 9], dtype=torch.uint8), dst=1, tag=8))
            for w in sends:
                assert w.wait()
            c.barrier()
            return []
        bufs = [torch.zeros(2, dtype=torch.uint8) for _ in range(4)]
        recvs = [c.irecv(bufs[3], src=0, tag=8)] + [c.irecv(b, src=0, tag=7) for b in bufs[:3]]
        for w in recvs:
            assert w.wait()
        c.barrier()
        return [b.tolist() for b in bufs]

    res = run_threads(body, 2)
    assert res[1] == [[1, 2], [3, 4], [5, 6], [9, 9]]


def test_issue11_fake_coordinator_receive_checks_size_and_peer():
    def body(c: ThreadCoordinator) -> str:
        if c.rank == 0:
            c.isend(torch.zeros(3, dtype=torch.uint8), dst=1, tag=1).wait()
            return "sent"
        with pytest.raises(CollectiveError, match="got 3 x torch.uint8, the buffer holds 2"):
            c.irecv(torch.zeros(2, dtype=torch.uint8), src=0, tag=1).wait()
        with pytest.raises(CollectiveError, match="rank 0 returned"):
            c.irecv(torch.zeros(2, dtype=torch.uint8), src=0, tag=2).wait()  # never sent, sender gone
        return "checked"

    assert run_threads(body, 2, timeout=20) == ["sent", "checked"]


def test_issue11_fake_coordinator_results_in_rank_order_and_args():
    assert run_threads(lambda c, k: (c.rank, c.world_size, k), 4, "arg") == [(r, 4, "arg") for r in range(4)]
    with pytest.raises(ValueError):
        ThreadExchange(0)
    with pytest.raises(ValueError):
        ThreadCoordinator(ThreadExchange(2), 2)
