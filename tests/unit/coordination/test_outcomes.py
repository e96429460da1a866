"""run_stage's decisions without processes: what every rank raises for given per-rank outcomes,
and how exceptions travel between ranks (only exception classes are ever rebuilt)."""

from __future__ import annotations

import errno
import pickle

import pytest

from unickpt.coordination.outcomes import disagreement, pack, stage_error, unpack
from unickpt.errors import (
    MissingDataFileError,
    RankDisagreementError,
    RankFailures,
    RemoteRankError,
    ShapeMismatchError,
    StorageError,
)


def _raised(e: BaseException) -> BaseException:
    try:
        raise e
    except BaseException as caught:
        return caught


def test_same_checkpoint_error_type_everywhere_keeps_type_and_attributes():
    e0 = _raised(StorageError(errno.EACCES, "rank 0: write data/x.bin: permission denied"))
    e2 = _raised(StorageError(errno.EACCES, "write data/y.bin: permission denied"))
    outcomes = {0: pack(e0), 2: pack(e2)}
    for rank, local in ((0, e0), (1, None), (2, e2)):
        err = stage_error("save (write)", outcomes, rank, local)
        assert type(err) is StorageError and err.errno == errno.EACCES
        assert str(err) == (
            "[Errno 13] rank 0, save (write): write data/x.bin: permission denied\n"
            "rank 2, save (write): write data/y.bin: permission denied"
        )


def test_different_types_or_foreign_errors_give_rank_failures_with_objects():
    outcomes = {
        0: pack(_raised(PermissionError(errno.EACCES, "denied", "/x"))),
        1: pack(_raised(ShapeMismatchError("s"))),
    }
    err = stage_error("load (read)", outcomes, 2, None)
    assert isinstance(err, RankFailures) and sorted(err.failures) == [0, 1]
    assert isinstance(err.failures[0], PermissionError) and err.failures[0].errno == errno.EACCES
    assert err.failures[0].filename == "/x" and isinstance(err.failures[1], ShapeMismatchError)
    assert err.messages[1] == "ShapeMismatchError: s"
    solo = stage_error("load (read)", {0: pack(_raised(ValueError("v")), transport=False)}, 0, ValueError("v"))
    assert isinstance(solo, RankFailures) and isinstance(solo.failures[0], ValueError)
    again = pickle.loads(pickle.dumps(err))  # travels itself (e.g. inside AsyncSaveFailures)
    assert isinstance(again, RankFailures) and again.failures[0].errno == errno.EACCES


class _Odd(Exception):
    def __init__(self, a: str, b: int) -> None:
        super().__init__(f"{a}{b}")


CALLED: list[str] = []


def _side_effect(what: str) -> None:
    CALLED.append(what)


class _Evil:
    def __reduce__(self):
        return (_side_effect, ("ran code from a peer",))


def test_transport_rebuilds_only_exception_classes():
    odd = unpack(1, pack(_raised(_Odd("x", 1))))
    assert isinstance(odd, RemoteRankError) and odd.type_name == "_Odd" and "x1" in str(odd)
    assert "_raised" in odd.traceback_text
    hostile = pack(_raised(MissingDataFileError("m")))
    hostile = type(hostile)(hostile.error_type, True, "m", "", pickle.dumps(_Evil()))
    stand_in = unpack(1, hostile)  # a function is not an exception class: never called
    assert isinstance(stand_in, RemoteRankError) and stand_in.type_name == "MissingDataFileError"
    assert CALLED == []


def test_disagreement_lists_every_rank_value():
    claims = {r: (("path", repr(f"/c/{r % 2}")), ("role", "None")) for r in range(5)}
    err = disagreement("save (describe state)", claims)
    assert isinstance(err, RankDisagreementError)
    assert "'/c/0' on ranks 0, 2, 4; '/c/1' on ranks 1, 3" in str(err)
    assert err.values == {"path": {r: repr(f"/c/{r % 2}") for r in range(5)}}
    assert disagreement("x", {r: (("path", "'/c'"),) for r in range(3)}) is None
    with pytest.raises(RankDisagreementError):
        raise pickle.loads(pickle.dumps(err))
