"""Guards the private torch.distributed accessors unickpt relies on (coordination._torch_private):
each check fails loudly when a torch release changes what it reads or sets."""

from __future__ import annotations

import datetime

import torch

from tests.workers.harness import run_ranks


def _probe(rank: int, ws: int) -> dict:
    import torch.distributed as dist

    from unickpt.coordination import _torch_private as private

    out: dict = {"job_timeout": private.job_timeout().total_seconds()}
    store = private.default_store()
    store.set(f"probe/{rank}", str(rank))
    store.wait([f"probe/{1 - rank}"], datetime.timedelta(seconds=60))
    out["peer_key"] = store.get(f"probe/{1 - rank}").decode()
    group = dist.new_group(ranks=[0, 1], backend="gloo", timeout=datetime.timedelta(hours=1))
    out["live"] = private.group_is_live(group)
    private.set_group_timeout(group, datetime.timedelta(seconds=2))
    # the new deadline is the one the group's collectives use: rank 1 never joins this all_reduce
    # (were the setter ineffective, rank 0 would wait an hour and the launcher's timeout fail it)
    if rank == 0:
        t = torch.zeros(1)
        try:
            dist.all_reduce(t, group=group)
            out["timed_out"] = False
        except RuntimeError as e:
            out["timed_out"] = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        store.set("probe/done", "1")
    else:
        store.wait(["probe/done"], datetime.timedelta(seconds=60))
    dist.destroy_process_group()
    out["live_after_destroy"] = private.group_is_live(group)
    return out


def test_private_torch_accessors_still_work():
    res = run_ranks(_probe, 2, init_timeout=7, timeout=180)
    for rank, r in enumerate(res):
        assert r["job_timeout"] == 7.0, r  # the timeout given to init_process_group
        assert r["peer_key"] == str(1 - rank), r  # the job's store, shared by the ranks
        assert r["live"] and not r["live_after_destroy"], r
    assert res[0]["timed_out"], res[0]  # set_group_timeout changed the group's deadline
