"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/test_boundaries.py``, which holds its single-process tests."""

from __future__ import annotations

import pytest


def _unencodable(rank: int, ws: int) -> object:
    class Opaque:  # only pickle could carry it
        pass

    return Opaque()


def test_issue11_boundaries_launcher_refuses_results_only_pickle_could_carry():
    from unickpt.testing.launch import RanksFailed, run_ranks

    with pytest.raises(RanksFailed) as ei:
        run_ranks(_unencodable, 0, timeout=120, threads=1)
    msg = str(ei.value)
    assert "rank 0 of 1 failed" in msg and "rank 0 result" in msg and "Opaque" in msg, msg
