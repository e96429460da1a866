"""The error-agreement stage (``coordination.run_stage``) across N ranks in one process
(``unickpt.testing.threads``): one failing rank makes every rank raise the same error, different
types give ``RankFailures`` holding the exception objects, ``agree=`` disagreement gives
``RankDisagreementError``, ``settle=`` applies the smallest count only after a success. Issue 11:
"tests of ... the error-agreement stage that do not exist today"."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

import pytest

from unickpt.coordination.base import Settle, run_stage
from unickpt.errors import (
    CheckpointError,
    RankDisagreementError,
    RankFailures,
    RemoteRankError,
    ShapeMismatchError,
    StorageError,
)
from unickpt.testing.threads import ThreadCoordinator, run_threads

WORLD_SIZES = [1, 2, 3, 5]


def _each_rank(ws: int, stage_fn: Callable[[ThreadCoordinator], Any]) -> list[dict[str, Any]]:
    """Run ``stage_fn`` on every thread-rank; what each returned or raised (the object itself)."""

    def body(c: ThreadCoordinator) -> dict[str, Any]:
        calls_before = len(c.calls)
        try:
            out = {"result": stage_fn(c), "error": None}
        except Exception as e:
            out = {"result": None, "error": e}
        out["collectives"] = c.calls[calls_before:]
        return out

    return run_threads(body, ws, timeout=20)


class NotRebuildable(Exception):
    """Pickles, but cannot be rebuilt from its args: travels as a RemoteRankError."""

    def __init__(self, a: str, b: int) -> None:
        super().__init__(f"{a}:{b}")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_issue11_run_stage_success_returns_each_ranks_result_in_one_round_trip(ws):
    res = _each_rank(ws, lambda c: run_stage(c, "save (plan)", lambda: c.rank * 3))
    assert [r["result"] for r in res] == [3 * q for q in range(ws)]
    assert all(r["error"] is None for r in res)
    assert all(r["collectives"] == ([] if ws == 1 else ["all_gather_object"]) for r in res)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_issue11_run_stage_one_failing_rank_makes_every_rank_raise_the_same_type(ws):
    bad = ws - 1
    path = f"/ckpt/data/r{bad}.bin"

    def local(c: ThreadCoordinator) -> int:
        if c.rank == bad:
            raise StorageError(errno.ENOSPC, f"write {path}: no space left on device")
        return c.rank

    res = _each_rank(ws, lambda c: run_stage(c, "save (write)", lambda: local(c)))
    for r in res:
        err = r["error"]
        assert type(err) is StorageError, err
        assert err.errno == errno.ENOSPC
        assert f"rank {bad}, save (write): write {path}: no space left on device" in str(err)
    assert len({str(r["error"]) for r in res}) == 1  # the same message on every rank
    assert isinstance(res[bad]["error"].__cause__, StorageError)  # the failing rank keeps its own


@pytest.mark.parametrize("ws", [2, 3, 5])
def test_issue11_run_stage_several_ranks_same_type_lists_each(ws):
    failing = list(range(0, ws, 2))

    def local(c: ThreadCoordinator) -> None:
        if c.rank in failing:
            raise ShapeMismatchError(f"model.w{c.rank}: saved (4,), live (5,)")

    res = _each_rank(ws, lambda c: run_stage(c, "load (check)", lambda: local(c)))
    for r in res:
        err = r["error"]
        assert type(err) is ShapeMismatchError
        lines = str(err).splitlines()
        assert lines == [f"rank {q}, load (check): model.w{q}: saved (4,), live (5,)" for q in failing]


@pytest.mark.parametrize("ws", [2, 3, 5])
def test_issue11_run_stage_different_types_give_rank_failures_with_the_objects(ws):
    def local(c: ThreadCoordinator) -> None:
        if c.rank == 0:
            raise PermissionError(errno.EACCES, "injected: permission denied", "/ckpt/loader")
        if c.rank == 1:
            raise NotRebuildable("odd", 7)

    res = _each_rank(ws, lambda c: run_stage(c, "save (describe state)", lambda: local(c)))
    for rank, r in enumerate(res):
        err = r["error"]
        assert isinstance(err, RankFailures) and err.stage == "save (describe state)"
        assert sorted(err.failures) == [0, 1]
        f0 = err.failures[0]
        assert isinstance(f0, PermissionError) and f0.errno == errno.EACCES and f0.filename == "/ckpt/loader"
        f1 = err.failures[1]
        if rank == 1:
            assert type(f1) is NotRebuildable  # its own object
        else:  # another rank's exception that cannot be rebuilt: its type, text and traceback
            assert isinstance(f1, RemoteRankError) and f1.type_name == "NotRebuildable"
            assert "odd:7" in f1.message and "test_base_run_stage.py" in f1.traceback_text
        assert err.messages[0].startswith("PermissionError") and "odd:7" in err.messages[1]


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_issue11_run_stage_a_foreign_error_on_one_rank_gives_rank_failures(ws):
    """Not a CheckpointError (a bug, a framework error): RankFailures at every world size."""

    def local(c: ThreadCoordinator) -> None:
        if c.rank == 0:
            raise ValueError("framework blew up")

    res = _each_rank(ws, lambda c: run_stage(c, "load (describe)", lambda: local(c)))
    for r in res:
        err = r["error"]
        assert isinstance(err, RankFailures) and list(err.failures) == [0]
        assert isinstance(err.failures[0], ValueError) and str(err.failures[0]) == "framework blew up"


@pytest.mark.parametrize("ws", [2, 3, 5])
def test_issue11_run_stage_agree_disagreement_gives_rank_disagreement_error(ws):
    def claims(c: ThreadCoordinator) -> dict[str, object]:
        return {"path": f"/ckpt-{1000 + c.rank}" if c.rank else "/ckpt", "framework": "fsdp2"}

    res = _each_rank(ws, lambda c: run_stage(c, "save (describe state)", lambda: claims(c), agree=lambda v: v))
    for r in res:
        err = r["error"]
        assert isinstance(err, RankDisagreementError)
        assert set(err.values) == {"path"}  # the framework agrees
        assert err.values["path"] == {q: repr(f"/ckpt-{1000 + q}" if q else "/ckpt") for q in range(ws)}
        assert all(f"rank {q}" in str(err) for q in range(ws)) and "every rank must pass the same path" in str(err)
    agreeing = _each_rank(ws, lambda c: run_stage(c, "s", lambda: {"path": "/same"}, agree=lambda v: v))
    assert [r["result"] for r in agreeing] == [{"path": "/same"}] * ws


@pytest.mark.parametrize("ws", [2, 3, 5])
def test_issue11_run_stage_failure_wins_over_disagreement(ws):
    def local(c: ThreadCoordinator) -> str:
        if c.rank == 1:
            raise StorageError(errno.EIO, "read failed")
        return f"/p{c.rank}"

    res = _each_rank(ws, lambda c: run_stage(c, "load", lambda: local(c), agree=lambda v: {"path": v}))
    assert all(type(r["error"]) is StorageError for r in res)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_issue11_run_stage_settle_applies_the_smallest_count_after_success(ws):
    def stage(c: ThreadCoordinator, fail: bool) -> list[int]:
        applied: list[int] = []

        def local() -> None:
            if fail and c.rank == ws - 1:
                raise StorageError(errno.EIO, "boom")

        settle = Settle(count=lambda: 10 + c.rank, apply=applied.append)
        try:
            run_stage(c, "save (describe state)", local, settle=settle)
        except CheckpointError:
            pass
        return applied

    assert run_threads(lambda c: stage(c, False), ws) == [[10]] * ws  # everyone: the minimum
    assert run_threads(lambda c: stage(c, True), ws) == [[]] * ws  # a failed stage settles nothing


@pytest.mark.parametrize("ws", [2, 3])
def test_issue11_run_stage_settle_apply_may_raise_on_every_rank(ws):
    class Reported(CheckpointError):
        pass

    def apply(n: int) -> None:
        raise Reported(f"{n} earlier async save(s) failed")

    def stage(c: ThreadCoordinator) -> object:
        return run_stage(c, "save (describe state)", lambda: None, settle=Settle(lambda: 1 + c.rank, apply))

    res = _each_rank(ws, stage)
    assert all(isinstance(r["error"], Reported) and str(r["error"]) == "1 earlier async save(s) failed" for r in res)
