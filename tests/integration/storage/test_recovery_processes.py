"""Fast recovery (issue 40): ``TieredCheckpointManager(replicas >= 1)`` on simulated hosts, each a
set of gloo ranks with its own ``UNICKPT_HOST_ID`` and a private ``UNICKPT_SHM_ROOT`` folder as
its RAM (no host's code reads another host's folder: replicas travel through the tier's process
group). Expected values come from seeded generators (``recovery_workers.expected``), expected
byte counts from the files found in each host's folder."""

from __future__ import annotations

import os

from tests.workers.harness import run_ranks
from tests.workers.recovery_workers import recover, save_steps

OPTS = {"replicas": 1, "keep_fast": 2, "durable_every": 100, "chunk_bytes": 16384}
META = "unickpt.metadata.json"


def _held(base: str, host: str, stepdir: str) -> dict[str, int]:
    """The checkpoint files of ``stepdir`` in ``host``'s RAM folder (primaries and replicas): name -> size."""
    out: dict[str, int] = {}
    top = os.path.join(base, "ram", host)
    for folder, _, files in os.walk(top):
        for f in files:
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, top).split(os.sep)
            if stepdir not in rel:
                continue
            name = "/".join(rel[rel.index(stepdir) + 1 :])
            if name == META or (name.startswith("data/") and name.endswith(".bin")):  # not the phase records
                out[name] = os.path.getsize(path)
    return out


def test_issue40_item1_2_3_a_hosts_lost_ram_is_rebuilt_from_peers(tmp_path):
    base, hosts = str(tmp_path), ["a", "b", "c"]
    run_ranks(save_steps, 3, base, hosts, [1, 2, 3], OPTS)
    held = {h: _held(base, h, "step_00000003") for h in hosts}
    every = {n: s for h in hosts for n, s in held[h].items()}
    assert all(len(held[h]) > 1 for h in hosts)
    os.system(f"rm -rf {base}/ram/b")  # host b's RAM is gone
    res = run_ranks(recover, 3, base, hosts, OPTS)
    assert [r["step"] for r in res] == [3, 3, 3] and all(r["exact"] for r in res), res
    total = sum(every.values())
    local = sum(held["a"].values()) + sum(held["c"].values())
    assert res[0]["bytes"] == {"local": local, "peer": 3 * total - local}
    assert res[0]["tier"] == "ram" and res[0]["failed"] == []


def test_issue40_item3_processes_killed_with_hosts_intact_move_no_byte_between_hosts(tmp_path):
    base, hosts = str(tmp_path), ["a", "b", "c"]
    run_ranks(save_steps, 3, base, hosts, [1, 2], OPTS, False)
    res = run_ranks(recover, 3, base, hosts, OPTS, False)
    assert [r["step"] for r in res] == [2, 2, 2] and all(r["exact"] for r in res), res
    assert res[0]["bytes"].get("peer", 0) == 0 and res[0]["peer_by_host"] == {}, res[0]


def test_issue40_item3_a_load_that_needs_a_file_its_host_lacks_fetches_it_and_loads_again(tmp_path):
    # the bias is in rank 0's file, held by hosts a and b only: host c's rank must fetch it
    base, hosts = str(tmp_path), ["a", "b", "c"]
    run_ranks(save_steps, 3, base, hosts, [1], OPTS)
    res = run_ranks(recover, 3, base, hosts, OPTS)
    assert [r["step"] for r in res] == [1, 1, 1] and all(r["exact"] for r in res), res
    assert res[0]["bytes"]["peer"] > 0 and res[0]["failed"] == []
