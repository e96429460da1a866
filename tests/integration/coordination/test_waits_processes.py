"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/coordination/test_waits.py``, which holds its single-process tests."""

from __future__ import annotations

from tests.workers.harness import run_ranks
from tests.workers.wait_workers import late_skipping_then_lost_peer


def test_issue26_item12_waiting_ranks_warn_and_every_collective_failure_is_a_collective_error(tmp_path):
    res = run_ranks(late_skipping_then_lost_peer, 2, str(tmp_path), 3, init_timeout=60, timeout=240)
    assert res[1]["skipped"]
    lines = res[0]["lines"]
    # rank 1 arrived late three times, each time only after rank 0 had warned naming it: at the
    # creation of unickpt's groups, at a collective and at the commit barrier
    for what in (
        f"save of {tmp_path}/a: creating unickpt's process groups: still waiting after",
        f"save of {tmp_path}/b: all_gather_object (collective #",
        f"save of {tmp_path}/c: the commit barrier after save (write): still waiting after",
    ):
        assert any(line.startswith(f"rank 0: {what}") and "rank(s) [1] have not" in line for line in lines), what
    assert any("rank(s) [1] have not reported the end of save (write) yet" in line for line in lines)
    # rank 1 skipped save d: warnings naming it, then (and only then) the deadline's error
    d = [i for i, line in enumerate(lines) if f"{tmp_path}/d" in line]
    assert lines[d[-1]].startswith(f"ERROR CollectiveTimeoutError: save of {tmp_path}/d:"), lines[d[-1]]
    assert "timed out after 4s: rank(s) [1] did not arrive" in lines[d[-1]]
    warned = [lines[i] for i in d[:-1]]
    assert warned and all("still waiting after" in w and "rank(s) [1] have not arrived yet" in w for w in warned)
    # a peer whose unickpt groups are gone (closed connections): every call on rank 0 raises
    # CollectiveError, whether the failure comes at posting a transfer, waiting for it, or a
    # collective; repeated, as the race between the two used to let torch's RuntimeError escape
    assert len(res[0]["rounds"]) == 3
    for got in res[0]["rounds"]:
        assert set(got) == {"all_gather_object", "broadcast_object", "barrier", "isend", "irecv", "save"}
        assert all(v.startswith("CollectiveError:") for v in got.values()), got
