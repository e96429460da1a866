"""The commit barrier (``coordination.barrier``) on thread-ranks and their in-memory store: rank 0
commits only once every rank reported, with every payload in rank order; reported failures give
every rank the error ``run_stage`` would; a rank that never reports (or a late rank 0) fails every
other rank with one ``CollectiveTimeoutError`` naming it and the stage; the keys are removed."""

from __future__ import annotations

import errno
import threading
from typing import Any

import pytest

from unickpt.coordination.barrier import commit_barrier
from unickpt.coordination.single import SingleProcessCoordinator
from unickpt.coordination.store import MemoryStore
from unickpt.coordination.topology import TreeLayout
from unickpt.errors import CollectiveTimeoutError, RankFailures, StorageError
from unickpt.testing.threads import ThreadCoordinator, run_threads

STAGES = {"stage": "save (write)", "commit_stage": "save (commit)"}


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        return {"result": fn(), "error": None}
    except Exception as e:
        return {"result": None, "error": e}


@pytest.mark.parametrize("ws", [2, 3, 5])
def test_rank_0_commits_every_payload_in_rank_order_and_the_keys_go(ws):
    commits: list[list[bytes]] = []
    stores: list[MemoryStore] = []

    def body(c: ThreadCoordinator) -> Any:
        stores.append(c.exchange.store)
        decided: list[int] = []
        out = commit_barrier(
            c,
            "save-1",
            lambda: f"payload of {c.rank}".encode() * (c.rank + 1),
            lambda payloads: commits.append(payloads) or "metadata",
            on_decided=lambda: decided.append(c.rank),
            **STAGES,
        )
        return out, decided

    res = run_threads(body, ws, timeout=20)
    assert res == [("metadata", [0])] + [(None, [r]) for r in range(1, ws)]
    assert commits == [[f"payload of {r}".encode() * (r + 1) for r in range(ws)]]
    assert stores[0].keys() == []  # the last rank to learn the outcome removed the barrier's keys


def test_rank_0_does_not_commit_before_a_held_rank_reports():
    """Rank 2's report is held until rank 0 waits in the barrier (the store tells when it starts
    waiting): the commit must see rank 2's report, and rank 2 released by then."""
    rank0_waits, released = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def body(c: ThreadCoordinator) -> Any:
        if c.rank == 0:

            def waiting(keys: list[str]) -> None:
                if threading.current_thread().name.endswith("rank0"):
                    rank0_waits.set()

            c.exchange.store.on_wait = waiting

        def report() -> bytes:
            if c.rank == 2:
                assert rank0_waits.wait(30), "rank 0 never waited in the barrier"
                seen["committed while held"] = "commit" in seen
                released.set()
            return bytes([c.rank])

        def commit(payloads: list[bytes]) -> str:
            seen["commit"] = (released.is_set(), payloads)
            return "md"

        return commit_barrier(c, "held", report, commit, **STAGES)

    assert run_threads(body, 4, timeout=30) == ["md", None, None, None]
    assert seen == {"committed while held": False, "commit": (True, [b"\x00", b"\x01", b"\x02", b"\x03"])}


def test_reported_failures_give_every_rank_the_error_run_stage_gives():
    def body(c: ThreadCoordinator, bad: dict[int, BaseException]) -> dict[str, Any]:
        def report() -> bytes:
            if c.rank in bad:
                raise bad[c.rank]
            return b"ok"

        return _outcome(lambda: commit_barrier(c, "f", report, lambda p: pytest.fail("committed"), **STAGES))

    same = {1: StorageError(errno.ENOSPC, "rank 1: disk full"), 2: StorageError(errno.EIO, "rank 2: io")}
    res = run_threads(body, 3, same, timeout=20)
    assert all(type(r["error"]) is StorageError for r in res), res
    for r in res:
        msg = str(r["error"])
        assert "rank 1, save (write): disk full" in msg and "rank 2, save (write): io" in msg, msg
    assert res[1]["error"].errno == errno.ENOSPC  # the failing rank raises its own, retitled
    mixed = {0: StorageError("rank 0: broken"), 2: KeyError("odd")}
    res = run_threads(body, 3, mixed, timeout=20)
    assert all(isinstance(r["error"], RankFailures) and sorted(r["error"].failures) == [0, 2] for r in res)


def test_a_failed_commit_is_every_ranks_error():
    def body(c: ThreadCoordinator) -> dict[str, Any]:
        def commit(payloads: list[bytes]) -> None:
            raise StorageError(errno.EACCES, "cannot publish the metadata")

        return _outcome(lambda: commit_barrier(c, "c", lambda: b"x", commit, **STAGES))

    res = run_threads(body, 3, timeout=20)
    assert all(type(r["error"]) is StorageError for r in res)
    assert all("rank 0, save (commit): cannot publish the metadata" in str(r["error"]) for r in res)


def test_issue41_item2_a_failed_barrier_leaves_no_key_behind():
    """After a failed commit every rank counts out and the last removes the barrier's keys; rank 0's
    linger (waiting for the others to count out) must not recreate the counter the last rank removed
    (it did, and then waited its whole linger for a counter that stays 0)."""
    stores: list[MemoryStore] = []

    def body(c: ThreadCoordinator) -> dict[str, Any]:
        stores.append(c.exchange.store)

        def commit(payloads: list[bytes]) -> None:
            raise StorageError(errno.EACCES, "cannot publish the metadata")

        return _outcome(lambda: commit_barrier(c, "gone", lambda: b"x", commit, **STAGES))

    res = run_threads(body, 3, timeout=20)
    assert all(type(r["error"]) is StorageError for r in res)
    assert stores[0].keys() == []


def test_a_rank_that_never_reports_is_named_with_the_stage_on_every_other_rank():
    gone = threading.Event()

    def body(c: ThreadCoordinator) -> dict[str, Any]:
        if c.rank == 2:  # dies in its write: never reports
            return {"result": "died", "error": None}
        out = _outcome(lambda: commit_barrier(c, "k", lambda: b"x", lambda p: pytest.fail("committed"), **STAGES))
        gone.set()
        return out

    res = run_threads(body, 4, timeout=1.0)
    errors = [r["error"] for q, r in enumerate(res) if q != 2]
    assert all(isinstance(e, CollectiveTimeoutError) and e.missing_ranks == (2,) for e in errors), errors
    assert len({str(e) for e in errors}) == 1  # one decision, the same error everywhere
    msg = str(errors[0])
    assert "rank(s) [2] did not report the end of save (write) within 1s" in msg and "nothing was committed" in msg


def test_a_late_rank_0_learns_that_the_others_gave_up():
    others_failed = threading.Event()
    failed: list[int] = []

    def body(c: ThreadCoordinator) -> dict[str, Any]:
        if c.rank == 0:
            assert others_failed.wait(30)
        out = _outcome(lambda: commit_barrier(c, "late", lambda: b"x", lambda p: pytest.fail("committed"), **STAGES))
        if c.rank != 0:
            failed.append(c.rank)
            if len(failed) == c.world_size - 1:
                others_failed.set()
        return out

    res = run_threads(body, 3, timeout=1.0)
    errors = [r["error"] for r in res]
    assert all(isinstance(e, CollectiveTimeoutError) and e.missing_ranks == (0,) for e in errors), errors
    assert len({str(e) for e in errors}) == 1 and "rank(s) [0] did not report" in str(errors[0])


def test_over_a_tree_and_without_a_store_the_contract_is_the_same():
    def body(c: Any) -> Any:
        return commit_barrier(c, "t", lambda: bytes([c.rank]), b"".join, **STAGES)

    tree = run_threads(body, 5, timeout=20, tree=TreeLayout.build([2, 2, 1], 2))
    assert tree == [b"\x00\x01\x02\x03\x04", None, None, None, None]

    class NoStore(ThreadCoordinator):
        def store_scope(self) -> None:  # type: ignore[override]
            return None

    def no_store(c: ThreadCoordinator) -> Any:
        c2 = NoStore(c.exchange, c.rank)
        ok = commit_barrier(c2, "n", lambda: bytes([c.rank]), b"".join, **STAGES)

        def report() -> bytes:
            if c.rank == 1:
                raise StorageError("rank 1: full")
            return b""

        bad = _outcome(lambda: commit_barrier(c2, "m", report, lambda p: None, **STAGES))
        return ok, type(bad["error"]).__name__, c2.calls

    res = run_threads(no_store, 3, timeout=20)
    assert [r[:2] for r in res] == [(b"\x00\x01\x02", "StorageError"), (None, "StorageError"), (None, "StorageError")]
    assert res[0][2] == ["all_gather_object", "gather_object", "all_gather_object", "all_gather_object"]
    single = commit_barrier(SingleProcessCoordinator(), "s", lambda: b"one", lambda p: p, **STAGES)
    assert single == [b"one"]
