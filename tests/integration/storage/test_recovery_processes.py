"""Fast recovery (issue 40): ``TieredCheckpointManager(replicas >= 1)`` on simulated hosts, each a
set of gloo ranks with its own ``UNICKPT_HOST_ID`` and a private ``UNICKPT_SHM_ROOT`` folder as
its RAM (no host's code reads another host's folder: replicas travel through the tier's process
group). Expected values come from seeded generators (``recovery_workers.expected``), expected
byte counts from the files found in each host's folder."""

from __future__ import annotations

import json
import os

import pytest

from tests.workers.harness import launch_ranks, run_ranks
from tests.workers.recovery_workers import (
    construct,
    dies_while_replicating,
    latest_step,
    loads_the_durable_step,
    recover,
    recover_big,
    recovers_then_gets_sigterm,
    save_big,
    save_steps,
    saves_a_nan_step,
    saves_after_a_link_is_planted,
    saves_then_gets_sigterm,
)

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
    # one pass: b fetches the metadata; b's rank reads its own file from c (b's ring successor, its
    # replica holder); the bias lives in rank 0's file, which b and c do not hold: their loads read
    # its bytes from a. What each host takes from its own RAM: its own file and the metadata
    own = [{n: s for n, s in every.items() if os.path.basename(n).startswith(f"r0000{i}-")} for i in range(3)]
    r0, r1, r2 = (sum(o.values()) for o in own)
    own_b = own[1]
    assert res[0]["bytes"]["local"] == r0 + r2 + 2 * every[META], res[0]
    by_host = res[0]["peer_by_host"]
    assert by_host["c"] == r1 + every[META] and 0 < by_host["a"] <= 2 * r0, res[0]
    assert set(by_host) == {"a", "c"} and res[0]["bytes"]["peer"] == sum(by_host.values())
    assert res[0]["fed"] == res[0]["bytes"]["peer"] - every[META]
    assert _held(base, "b", "step_00000003") == {**own_b, META: every[META]}  # its own file written back
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


def _flip_every_file(folder: str) -> list[str]:
    """Flip one byte in the middle of every checkpoint file under ``folder``; their paths."""
    flipped = []
    for top, _, files in os.walk(folder):
        for f in files:
            if f == META or f.endswith(".bin"):
                path = os.path.join(top, f)
                with open(path, "r+b") as fh:
                    fh.seek(os.path.getsize(path) // 2)
                    b = fh.read(1)
                    fh.seek(-1, 1)
                    fh.write(bytes([b[0] ^ 0xFF]))
                flipped.append(path)
    return flipped


def test_issue40_item3_every_file_of_one_hosts_ram_corrupted_is_detected_and_other_copies_used(tmp_path):
    base, hosts = str(tmp_path), ["a", "b", "c"]
    run_ranks(save_steps, 3, base, hosts, [1], OPTS)
    held_b = _held(base, "b", "step_00000001")
    assert len(_flip_every_file(os.path.join(base, "ram", "b"))) == len(held_b) > 2
    res = run_ranks(recover, 3, base, hosts, OPTS)
    assert [r["step"] for r in res] == [1, 1, 1] and all(r["exact"] for r in res), res
    named = {f.split("#")[0][len("b:") :] for f in res[0]["failed"] if f.startswith("b:")}
    assert named == set(held_b), res[0]["failed"]
    assert any("failed copy b:" in e for e in res[0]["events"])


def test_issue40_item3_a_short_replica_is_no_copy_and_the_next_holder_supplies_the_file(tmp_path):
    # replicas=2 on 3 hosts: host b's files are on a and c too. b's RAM is lost and c's copy of
    # b's rank's file is cut short: c does not list it (a copy of another length is no copy), so
    # a, the next holder from b, sends that file and c, the nearest, the metadata; no copy fails
    base, hosts = str(tmp_path), ["a", "b", "c"]
    opts = {**OPTS, "replicas": 2}
    run_ranks(save_steps, 3, base, hosts, [1], opts, False)
    held_b = _held(base, "b", "step_00000001")
    [name] = [n for n in held_b if os.path.basename(n).startswith("r00001-")]
    job_c = os.path.join(base, "ram", "c", f"unickpt-{os.getuid()}", "job")
    path = os.path.join(job_c, "replicas", "b", "step_00000001", *name.split("/"))
    size = os.path.getsize(path)
    assert size > OPTS["chunk_bytes"] + 1, size
    os.truncate(path, OPTS["chunk_bytes"] + 1)  # the first chunk whole, the last one short
    os.system(f"rm -rf {base}/ram/b")
    res = run_ranks(recover, 3, base, hosts, opts, False)
    assert [r["step"] for r in res] == [1, 1, 1] and all(r["exact"] for r in res), res
    assert res[0]["failed"] == [] and res[0]["peer_by_host"] == {"a": size, "c": held_b[META]}, res[0]


def _job_root(base: str, host: str) -> str:
    return os.path.join(base, "ram", host, f"unickpt-{os.getuid()}", "job")


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def test_issue40_item3_a_lost_hosts_file_is_read_from_its_holder_then_written_back_into_its_ram(tmp_path):
    # replicas=1 on 3 hosts (ring a -> b -> c): b's files are replicated on c. b's RAM is lost; its
    # rank's load reads b's file from c straight into the state (no copy in b's RAM first), then the
    # file is written back into b's RAM in the background (tiers.close waits for it). Proof that the
    # copy written back is complete and committed: c's RAM is lost next, and the job recovers again
    # with b's file read from b's own RAM and c's from a
    base, hosts = str(tmp_path), ["a", "b", "c"]
    run_ranks(save_steps, 3, base, hosts, [1], OPTS, False)
    stepdir = "step_00000001"
    held = {h: _held(base, h, stepdir) for h in hosts}
    [name_b] = [n for n in held["b"] if os.path.basename(n).startswith("r00001-")]
    [name_c] = [n for n in held["c"] if os.path.basename(n).startswith("r00002-")]
    primary_b = os.path.join(_job_root(base, "b"), stepdir, *name_b.split("/"))
    before = _read(primary_b)
    os.system(f"rm -rf {base}/ram/b")
    res = run_ranks(recover, 3, base, hosts, OPTS, False)
    assert [r["step"] for r in res] == [1, 1, 1] and all(r["exact"] for r in res), res
    assert res[0]["failed"] == [] and res[0]["peer_by_host"] == {"c": len(before) + held["c"][META]}, res[0]
    assert res[0]["fed"] == len(before)  # read by the load itself, not written into b's RAM before it
    assert _read(primary_b) == before  # written back after the load
    assert _held(base, "b", stepdir) == {name_b: len(before), META: held["c"][META]}
    with open(_markers(base, stepdir)[1]) as fh:
        assert {e["name"] for e in json.load(fh)["files"]} == {name_b, META}
    os.system(f"rm -rf {base}/ram/c")
    res = run_ranks(recover, 3, base, hosts, OPTS, False)
    assert [r["step"] for r in res] == [1, 1, 1] and all(r["exact"] for r in res), res
    assert res[0]["failed"] == [] and res[0]["peer_by_host"] == {"a": held["c"][name_c] + held["c"][META]}, res[0]
    assert res[0]["fed"] == held["c"][name_c]


def test_issue40_item3_a_lost_host_with_two_ranks_reads_both_files_from_its_holder(tmp_path):
    # host a runs two ranks; its RAM is lost. Each of its ranks reads its own file from b (a's ring
    # successor, its replica holder), which serves both until both have said they are done; then
    # both files are written back into a's RAM
    base, hosts = str(tmp_path), ["a", "a", "b", "c"]
    run_ranks(save_steps, 4, base, hosts, [1], OPTS, False)
    stepdir = "step_00000001"
    held_a = _held(base, "a", stepdir)
    own = {n: s for n, s in held_a.items() if os.path.basename(n).startswith(("r00000-", "r00001-"))}
    assert len(own) == 2, held_a
    os.system(f"rm -rf {base}/ram/a")
    res = run_ranks(recover, 4, base, hosts, OPTS, False)
    assert [r["step"] for r in res] == [1] * 4 and all(r["exact"] for r in res), res
    assert res[0]["failed"] == [] and res[0]["fed"] == sum(own.values()), res[0]
    assert res[0]["peer_by_host"] == {"b": sum(own.values()) + held_a[META]}, res[0]
    assert _held(base, "a", stepdir) == {**own, META: held_a[META]}


def test_issue40_item3_a_holders_copy_that_fails_the_loads_check_is_named_and_the_next_copy_used(tmp_path):
    # replicas=2: b's files are on c and a. b's RAM is lost and c's copy of b's rank's file has a
    # flipped byte: b's load reads it from c (the nearest holder), the load's CRC32C check fails,
    # and the second pass verifies every copy, names c's and completes b's file from a's
    base, hosts = str(tmp_path), ["a", "b", "c"]
    opts = {**OPTS, "replicas": 2}
    run_ranks(save_steps, 3, base, hosts, [1], opts, False)
    stepdir = "step_00000001"
    [name] = [n for n in _held(base, "b", stepdir) if os.path.basename(n).startswith("r00001-")]
    replica = os.path.join(_job_root(base, "c"), "replicas", "b", stepdir, *name.split("/"))
    assert _flip_every_file(os.path.dirname(replica)) == [replica]
    os.system(f"rm -rf {base}/ram/b")
    res = run_ranks(recover, 3, base, hosts, opts, False)
    assert [r["step"] for r in res] == [1, 1, 1] and all(r["exact"] for r in res), res
    assert {f.split("#")[0] for f in res[0]["failed"]} == {f"c:{name}"}, res[0]["failed"]
    assert res[0]["peer_by_host"]["a"] >= os.path.getsize(replica), res[0]


def test_issue40_item3_all_copies_of_a_chunk_lost_falls_back_to_the_newest_durable_step(tmp_path):
    base, hosts = str(tmp_path), ["a", "b", "c"]
    opts = {**OPTS, "durable_every": 2, "keep_fast": 1}
    run_ranks(save_steps, 3, base, hosts, [1, 2, 3], opts)
    assert sorted(os.listdir(os.path.join(base, "durable"))) == ["latest", "step_00000002"]
    # rank 1's shard file of step 3: on host b (primary) and host c (replica); corrupt both
    victims = [
        os.path.join(top, f)
        for h in ("b", "c")
        for top, _, files in os.walk(os.path.join(base, "ram", h))
        for f in files
        if f == "r00001-00.bin" and "step_00000003" in top
    ]
    assert len(victims) == 2
    for path in victims:
        with open(path, "r+b") as fh:
            fh.write(b"\x00\x01\x02\x03")
    res = run_ranks(recover, 3, base, hosts, opts)
    assert [r["step"] for r in res] == [2, 2, 2] and all(r["exact"] for r in res), res
    assert res[0]["tier"] == "durable"
    assert any(s.startswith("step 3 ") for s in res[0]["skipped"]), res[0]["skipped"]
    assert res[0]["warnings"] and "step 3" in res[0]["warnings"][0]


def test_issue40_measured_a_recovery_whose_hosts_kept_their_ram_reads_each_byte_once(tmp_path):
    # each rank's shard is 8 MiB: the load reads it once and checks every chunk's CRC32C; the
    # recovery before it reads no data byte (before: it read and checked every primary first)
    base, hosts = str(tmp_path), ["a", "b", "c"]
    shard = 8 << 20
    run_ranks(save_big, 3, base, hosts, OPTS)
    res = run_ranks(recover_big, 3, base, hosts, OPTS)
    assert all(r["error"] == "" and r["step"] == 1 and r["exact"] for r in res), res
    assert all(shard <= r["read"] < 1.5 * shard for r in res), [r["read"] for r in res]
    # with the load's check turned off, the recovery checks the copies itself: read twice
    res = run_ranks(recover_big, 3, base, hosts, {**OPTS, "_verify": False})
    assert all(r["error"] == "" and r["step"] == 1 and r["exact"] for r in res), res
    assert all(r["read"] >= 2 * shard for r in res), [r["read"] for r in res]


def test_issue40_item1_a_link_planted_in_a_step_folder_before_recovery_is_the_same_error_on_every_rank(tmp_path):
    """After the save, host b's ``step_1/data`` folder is swapped for a link to a folder outside
    holding a canary: ``load_latest`` never reads or writes through it, and every rank raises the
    same error naming host b (none waits for b until the timeout); the canary is untouched."""
    base, hosts = str(tmp_path), ["a", "b", "c"]
    opts = {**OPTS, "timeout": 30.0}
    run_ranks(save_big, 3, base, hosts, opts)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary.txt").write_text("not unickpt's")
    data = os.path.join(base, "ram", "b", f"unickpt-{os.getuid()}", "job", "step_00000001", "data")
    os.rename(data, str(tmp_path / "aside"))
    os.symlink(str(outside), data)
    res = run_ranks(recover_big, 3, base, hosts, opts)
    errors = [r["error"] for r in res]
    assert len(set(errors)) == 1 and errors[0], errors  # the same error, word for word, on every rank
    assert errors[0].split(":")[0] in ("UnsafePathError", "StorageError", "ConfigurationError"), errors[0]
    assert "host b (rank 1)" in errors[0] and data in errors[0], errors[0]
    assert _files(str(outside)) == {"canary.txt": b"not unickpt's"}


def test_issue40_item3_a_corrupt_copy_met_by_the_load_with_no_other_copy_and_no_durable_step_raises_on_every_rank(
    tmp_path,
):
    # rank 1's shard file on host b (primary) and host c (replica) corrupted, nothing durable: the
    # load of the first pass had begun writing into the state, so load_latest cannot return None
    base, hosts = str(tmp_path), ["a", "b", "c"]
    run_ranks(save_big, 3, base, hosts, OPTS)
    victims = [
        os.path.join(top, f)
        for h in ("b", "c")
        for top, _, files in os.walk(os.path.join(base, "ram", h))
        for f in files
        if f == "r00001-00.bin"
    ]
    assert len(victims) == 2
    for path in victims:
        with open(path, "r+b") as fh:
            fh.write(b"\x00\x01\x02\x03")
    res = run_ranks(recover_big, 3, base, hosts, OPTS)
    assert all(r["error"].startswith("IntegrityError: no step can be recovered") for r in res), res
    assert all("a load of step 1 had begun" in r["error"] for r in res), res


def test_issue40_item3_a_durable_tier_that_cannot_answer_is_the_same_error_on_every_rank(tmp_path):
    # rank 0 asks the durable tier for its newest step on a thread of its own, beside the
    # inventories' gathering: its failure (here a planted 100 KiB `latest` pointer, over the
    # 64 KiB any pointer read stops at) still ends the decision with one error on every rank
    base, hosts = str(tmp_path), ["a", "b", "c"]
    opts = {**OPTS, "durable_every": 1}
    run_ranks(save_big, 3, base, hosts, opts)
    pointer = os.path.join(base, "durable", "latest")
    assert os.path.isfile(pointer)
    with open(pointer, "wb") as fh:
        fh.write(b"x" * (100 << 10))
    res = run_ranks(recover_big, 3, base, hosts, opts)
    [error] = {r["error"] for r in res}
    assert error.startswith("IntegrityError: no recovery decision: host a (rank 0): SizeLimitError: "), res
    assert "latest" in error, error
    assert all(r["read"] < (1 << 20) for r in res), res  # nothing of the state was loaded


def test_issue40_item5_the_durable_tier_holds_exactly_the_durable_every_steps_copied_from_ram(tmp_path):
    base, hosts = str(tmp_path), ["a", "b", "c"]
    opts = {**OPTS, "durable_every": 2, "keep_fast": 1}
    run_ranks(save_steps, 3, base, hosts, [1, 2, 3, 4, 5], opts)
    assert sorted(os.listdir(os.path.join(base, "durable"))) == ["latest", "step_00000002", "step_00000004"]
    os.system(f"rm -rf {base}/ram")  # every host's RAM is gone
    res = run_ranks(recover, 3, base, hosts, opts)
    assert [r["step"] for r in res] == [4, 4, 4] and all(r["exact"] for r in res), res
    assert res[0]["tier"] == "durable"


def test_issue40_item5_ram_keeps_the_step_due_on_the_durable_tier_until_its_durable_copy_commits(tmp_path):
    base, hosts = str(tmp_path), ["a", "b"]
    (tmp_path / "blocked").write_text("a file where the durable tier's folder should be")
    opts = {**OPTS, "durable_every": 2, "keep_fast": 1, "_durable": str(tmp_path / "blocked" / "durable")}
    out = run_ranks(save_steps, 2, base, hosts, [1, 2, 3], {**opts, "_expect_failure": True})
    assert all(o is not None and "step 2 was not copied to the durable tier" in o for o in out), out
    for h in hosts:  # keep_fast=1 kept step 3, and step 2 whose durable copy never committed
        markers = sorted(os.listdir(os.path.join(base, "ram", h, f"unickpt-{os.getuid()}", "job", "recovery")))
        assert markers == ["commit-step_00000002.json", "commit-step_00000003.json"], markers


def test_issue40_item7_a_step_with_nan_is_neither_promoted_nor_loaded_and_the_warning_names_the_tensor(tmp_path):
    base, hosts = str(tmp_path), ["a", "b"]
    opts = {**OPTS, "durable_every": 1, "check_finite": True}
    out = run_ranks(saves_a_nan_step, 2, base, hosts, opts)
    assert len(out[0]) == 1 and "step 2 holds NaN/Inf in model.w" in out[0][0], out
    assert sorted(os.listdir(os.path.join(base, "durable"))) == ["latest", "step_00000001"]
    res = run_ranks(recover, 2, base, hosts, opts)
    assert [r["step"] for r in res] == [1, 1] and all(r["exact"] for r in res), res
    assert any("step 2" in s and "non-finite values in model.w" in s for s in res[0]["skipped"]), res[0]


def test_issue40_item2_a_step_saved_again_by_a_resumed_job_replaces_its_ram_copies(tmp_path):
    base, hosts = str(tmp_path), ["a", "b", "c"]
    run_ranks(save_steps, 3, base, hosts, [1, 2], OPTS)
    first = {h: set(_held(base, h, "step_00000002")) for h in hosts}
    run_ranks(save_steps, 3, base, hosts, [2], OPTS)  # resumed from step 1, saves step 2 again
    second = {h: set(_held(base, h, "step_00000002")) for h in hosts}
    for h in hosts:  # only the new save's files (new save id), none of the old save's replicas left
        assert len({n.split("/")[1] for n in second[h] if n != META}) == 1, second[h]
        assert second[h].isdisjoint(first[h] - {META})
    # the new save's own metadata on rank 0's host stays (the old save's marker named the same file)
    assert os.path.isfile(os.path.join(base, "ram", "a", f"unickpt-{os.getuid()}", "job", "step_00000002", META))
    res = run_ranks(recover, 3, base, hosts, OPTS)
    assert [r["step"] for r in res] == [2, 2, 2] and all(r["exact"] for r in res), res


def test_issue40_item6_sigterm_flushes_the_newest_ram_step_to_the_durable_tier_then_ends_the_process(tmp_path):
    base, hosts = str(tmp_path), ["a", "b", "c"]
    opts = {**OPTS, "durable_every": 10}
    out = launch_ranks(saves_then_gets_sigterm, 3, base, hosts, opts, timeout=120, grace=60)
    assert [o.exitcode for o in out] == [-15, -15, -15], out
    assert sorted(os.listdir(os.path.join(base, "durable"))) == ["latest", "step_00000003"]
    os.system(f"rm -rf {base}/ram")
    res = run_ranks(recover, 3, base, hosts, opts)
    assert [r["step"] for r in res] == [3, 3, 3] and all(r["exact"] for r in res) and res[0]["tier"] == "durable"


def test_issue40_item4_a_host_lost_and_the_job_restarted_on_one_host_fewer_reshards_from_ram(tmp_path):
    base = str(tmp_path)
    run_ranks(save_steps, 4, base, ["a", "a", "b", "c"], [1, 2], OPTS)  # host a runs two ranks
    c_files = {n: s for n, s in _held(base, "c", "step_00000002").items() if os.path.basename(n).startswith("r00003-")}
    assert len(c_files) == 1, c_files
    os.system(f"rm -rf {base}/ram/c")  # host c is gone for good: no spare
    res = run_ranks(recover, 2, base, ["a", "b"], OPTS)
    assert [r["step"] for r in res] == [2, 2] and all(r["exact"] for r in res), res
    assert res[0]["tier"] == "ram" and res[0]["failed"] == []
    # rank 1 (on b) now holds the rows ranks 2 (b) and 3 (c) saved: it reads c's file from a, which
    # holds c's replica; nothing else crosses, and c's file is not copied into b's RAM (no host
    # gets the whole checkpoint: one pass, no materialisation)
    assert res[0]["fed"] == sum(c_files.values()) and res[0]["peer_by_host"] == {"a": sum(c_files.values())}
    assert not set(c_files) & set(_held(base, "b", "step_00000002"))


def test_issue40_item6_a_flush_after_a_restart_on_one_host_fewer_copies_the_lost_hosts_files_too(tmp_path):
    # step 2 is in RAM only (durable_every=10); host c is gone for good and the job restarts on a
    # and b. A SIGTERM then flushes step 2 to the durable tier: c's file must be copied by a host
    # that holds a copy of it (a holds c's replica), or the durable step would lack it
    base = str(tmp_path)
    opts = {**OPTS, "durable_every": 10}
    run_ranks(save_steps, 4, base, ["a", "a", "b", "c"], [1, 2], opts)
    os.system(f"rm -rf {base}/ram/c")
    out = launch_ranks(recovers_then_gets_sigterm, 2, base, ["a", "b"], opts, timeout=120, grace=60)
    assert [o.exitcode for o in out] == [-15, -15], out
    assert sorted(os.listdir(os.path.join(base, "durable"))) == ["latest", "step_00000002"]
    assert run_ranks(loads_the_durable_step, 3, base, ["x", "y", "z"], 2) == [True] * 3


def test_issue40_item3_a_host_replaced_by_a_machine_of_another_name_recovers_and_flushes_the_step_whole(tmp_path):
    # host b is replaced by a new machine, d (another host name, empty RAM), at the same size: d's
    # rank reads b's rank's rows from c (which holds b's replica) and the bias from a; nothing of
    # b's is written into d's RAM (d did not write it). A SIGTERM then flushes the recovered step:
    # b's file is copied to the durable tier from c's copy, and the durable step loads bit-exact
    base = str(tmp_path)
    opts = {**OPTS, "durable_every": 10}
    run_ranks(save_steps, 3, base, ["a", "b", "c"], [1], opts)
    [name_b] = [n for n in _held(base, "b", "step_00000001") if os.path.basename(n).startswith("r00001-")]
    os.system(f"rm -rf {base}/ram/b")
    res = run_ranks(recover, 3, base, ["a", "d", "c"], opts)
    assert [r["step"] for r in res] == [1, 1, 1] and all(r["exact"] for r in res), res
    assert res[0]["tier"] == "ram" and res[0]["failed"] == [] and res[0]["fed"] > 0, res[0]
    assert name_b not in _held(base, "d", "step_00000001")
    out = launch_ranks(recovers_then_gets_sigterm, 3, base, ["a", "d", "c"], opts, timeout=120, grace=60)
    assert [o.exitcode for o in out] == [-15] * 3, out
    assert sorted(os.listdir(os.path.join(base, "durable"))) == ["latest", "step_00000001"]
    assert run_ranks(loads_the_durable_step, 2, base, ["x", "y"], 1) == [True] * 2


def test_issue40_item2_a_kill_in_the_middle_of_replication_leaves_the_previous_step_in_use(tmp_path):
    base, hosts = str(tmp_path), ["a", "b", "c"]
    opts = {**OPTS, "timeout": 20.0}
    out = launch_ranks(dies_while_replicating, 3, base, hosts, opts, "c", victim=2, timeout=120, grace=30)
    assert out[2].exitcode == -9, out
    assert all(os.path.exists(p) for p in _markers(base, "step_00000001"))
    assert not any(os.path.exists(p) for p in _markers(base, "step_00000002")), "step 2 was committed somewhere"
    res = run_ranks(recover, 3, base, hosts, OPTS)
    assert [r["step"] for r in res] == [1, 1, 1] and all(r["exact"] for r in res), res


def _markers(base: str, stepdir: str) -> list[str]:
    return [os.path.join(base, "ram", h, f"unickpt-{os.getuid()}", "job", "recovery", f"commit-{stepdir}.json")
            for h in "abc"]  # fmt: skip


def test_issue40_item1_replicas_as_many_as_hosts_is_a_configuration_error_on_every_rank(tmp_path):
    out = run_ranks(construct, 2, str(tmp_path), ["a", "b"], [{**OPTS, "replicas": 2}] * 2)
    assert all(o.startswith("ConfigurationError: replicas=2 needs at least 3 hosts") for o in out), out


def test_issue40_item1_hosts_disagreeing_on_the_options_is_a_configuration_error_on_every_rank(tmp_path):
    out = run_ranks(construct, 2, str(tmp_path), ["a", "b"], [OPTS, {**OPTS, "keep_fast": 3}])
    assert all(o.startswith("ConfigurationError: the ranks' TieredCheckpointManager options differ") for o in out)
    assert all("rank 1 (host b)" in o for o in out), out


def test_issue40_item1_foreign_files_in_the_ram_tier_are_never_deleted_and_a_bogus_marker_is_ignored(tmp_path):
    base, hosts = str(tmp_path), ["a", "b"]
    root = os.path.join(base, "ram", "b", f"unickpt-{os.getuid()}")
    planted = [
        os.path.join(root, "job", "replicas", "a", "step_00000001", "foreign.bin"),
        os.path.join(root, "job", "step_00000001", "notes.txt"),
        os.path.join(root, "job", "recovery", "commit-step_00000099.json"),
    ]
    os.makedirs(root, mode=0o700)
    for path in planted:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "w") as fh:
            fh.write('{"format": "unickpt-ram-commit/1", "stepdir": "step_00000099"}')
    run_ranks(save_steps, 2, base, hosts, [1, 2, 3], {**OPTS, "keep_fast": 1})
    assert all(os.path.exists(p) for p in planted)
    assert _held(base, "b", "step_00000001") == {}  # unickpt's own copies of step 1: gone
    res = run_ranks(recover, 2, base, hosts, {**OPTS, "keep_fast": 1})
    assert [r["step"] for r in res] == [3, 3] and all(r["exact"] for r in res), res
    assert all(os.path.exists(p) for p in planted)


class _Host:
    """A simulated host with a RAM no other host can see: a mount namespace (``unshare -m``)
    holding a private tmpfs on ``ram``, kept alive by a holder process; its ranks enter it with
    ``nsenter``. ``lose()`` ends the namespace: its tmpfs and everything in it are gone."""

    def __init__(self, ram: str) -> None:
        import subprocess

        self.ram = ram
        self.holder = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs -o size=64m,mode=0700 tmpfs {ram} && echo ready && exec sleep 600"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.holder.stdout is not None and self.holder.stdout.readline().strip() == "ready"

    def rank(self, fn: str, rank: int, ws: int, port: int, out: str, args: list) -> object:
        import json
        import subprocess
        import sys

        cmd = ["nsenter", "-t", str(self.holder.pid), "-m", sys.executable, "-m", "tests.workers.recovery_workers",
               fn, str(rank), str(ws), str(port), out, json.dumps(args)]  # fmt: skip
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        path = os.pathsep.join([repo, os.path.join(repo, "src"), os.environ.get("PYTHONPATH", "")])  # tests.workers
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "RECOVERY_TEST_RAM": self.ram}
        return subprocess.Popen(cmd, env={**env, "PYTHONPATH": path}, cwd=repo)

    def lose(self) -> None:
        self.holder.kill()
        self.holder.wait()


def _job(hosts: dict[str, _Host], names: list[str], fn: str, args: list, tmp: str) -> list:
    import json

    from tests.workers.harness import free_port

    port = free_port()
    outs = [os.path.join(tmp, f"{fn}-{r}-{port}.json") for r in range(len(names))]
    procs = [hosts[h].rank(fn, r, len(names), port, outs[r], [tmp, names, *args]) for r, h in enumerate(names)]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0] * len(names), codes
    results = []
    for out in outs:
        with open(out) as fh:
            results.append(json.load(fh))
    return results


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces and tmpfs mounts need root")
def test_issue40_item2_hosts_in_their_own_mount_namespaces_rebuild_a_lost_hosts_private_tmpfs(tmp_path):
    """Three hosts, each a mount namespace with a private tmpfs at the same path ``ram``: a replica
    can reach another host only through the process group. Host b's namespace ends (its tmpfs is
    gone), b comes back with an empty one, the job restarts at the same size."""
    ram = str(tmp_path / "ram-tmpfs")
    os.makedirs(ram)
    opts = {**OPTS, "durable_every": 100}
    hosts = {h: _Host(ram) for h in "abc"}
    try:
        names = ["a", "b", "c"]
        _job(hosts, names, "save_steps", [[1, 2], opts], str(tmp_path))
        assert os.listdir(ram) == []  # nothing of any host's RAM is visible outside its namespace
        hosts["b"].lose()
        hosts["b"] = _Host(ram)
        res = _job(hosts, names, "recover", [opts], str(tmp_path))
        assert [r["step"] for r in res] == [2, 2, 2] and all(r["exact"] for r in res), res
        assert res[0]["tier"] == "ram" and res[0]["bytes"]["peer"] > 0 and res[0]["failed"] == []
    finally:
        for h in hosts.values():
            h.lose()


def _files(top: str) -> dict[str, bytes]:
    """Every file under ``top`` (links not followed): relative path -> contents (a link: its target)."""
    out = {}
    for folder, dirs, files in os.walk(top):
        for f in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, top)
            if os.path.islink(path):
                out[rel] = os.readlink(path).encode()
            else:
                with open(path, "rb") as fh:
                    out[rel] = fh.read()
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
@pytest.mark.parametrize(
    ("folder", "change"),
    [
        ("", "chown"),
        ("job", "chmod"),
        ("job/replicas/a", "chown"),
        ("job/step_00000001", "chmod"),
        ("job/replicas", "link"),
    ],
)
def test_issue40_item1_a_ram_folder_another_user_controls_is_a_configuration_error_on_every_rank(
    tmp_path, folder, change
):
    """Host b's RAM folder (the shm base, the fast root, a host's replica folder in it, a step
    folder) given to another user, opened to others, or a link planted in its place (the
    replicas folder): every rank fails at construction with a
    ConfigurationError naming the host and the folder, and nothing in any host's RAM changes."""
    base, hosts = str(tmp_path), ["a", "b"]
    opts = {**OPTS, "timeout": 30.0}
    run_ranks(save_steps, 2, base, hosts, [1], opts)
    ram = os.path.join(base, "ram")
    target = os.path.join(ram, "b", f"unickpt-{os.getuid()}", *folder.split("/") if folder else [])
    assert os.path.isdir(target)
    if change == "chown":
        os.chown(target, 65534, 65534)
    elif change == "link":  # the folder moved out, a link planted in its place
        os.rename(target, tmp_path / "moved")
        os.symlink(tmp_path / "moved", target)
    else:
        os.chmod(target, 0o777)
    before = {**_files(ram), **_files(str(tmp_path / "moved"))}
    out = run_ranks(construct, 2, base, hosts, [opts] * 2)
    for o in out:
        assert o.startswith("ConfigurationError: the RAM tier refuses 1 host(s) whose RAM folder is not"), out
        assert f"host b: {target} " in o, o
    assert {**_files(ram), **_files(str(tmp_path / "moved"))} == before


def test_issue40_item1_ram_retention_never_deletes_through_a_link_it_did_not_make(tmp_path):
    """Links planted in step 1's folders of both hosts (a step folder of a replica, a data folder
    of a primary, a data file) lead outside, to files named as the ones retention deletes: when
    keep_fast=1 drops step 1, those files survive, the links are not followed, and the newer
    steps still recover bit-exact."""
    base, hosts = str(tmp_path), ["a", "b"]
    opts = {**OPTS, "keep_fast": 1}
    run_ranks(save_steps, 2, base, hosts, [1], opts)
    root = {h: os.path.join(base, "ram", h, f"unickpt-{os.getuid()}", "job") for h in hosts}
    outside = tmp_path / "outside"
    planted = []
    # host b: its replica of host a's step 1 becomes a link to a copy outside
    rep = os.path.join(root["b"], "replicas", "a", "step_00000001")
    os.rename(rep, outside / "rep" if outside.mkdir() is None else "")
    os.symlink(outside / "rep", rep)
    planted.append(rep)
    # host a: its primary data folder of step 1 becomes a link to a copy outside
    data = os.path.join(root["a"], "step_00000001", "data")
    os.rename(data, outside / "data")
    os.symlink(outside / "data", data)
    planted.append(data)
    # host a: one file of its replica of host b's step 1 becomes a link to a file outside
    (victim,) = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root["a"], "replicas", "b")) for f in fs
                 if f.endswith(".bin")]  # fmt: skip
    os.rename(victim, outside / "victim.bin")
    os.symlink(outside / "victim.bin", victim)
    outside_before = _files(str(outside))
    assert len(outside_before) >= 4, outside_before
    run_ranks(save_steps, 2, base, hosts, [2, 3], opts)
    assert _files(str(outside)) == outside_before  # nothing outside deleted
    assert all(os.path.islink(p) for p in planted[:2])  # links to folders: left alone, not followed
    assert not os.path.lexists(victim)  # a link in a file's place: removed itself, never followed
    for h in hosts:
        markers = os.listdir(os.path.join(root[h], "recovery"))
        assert markers == ["commit-step_00000003.json"], markers
    res = run_ranks(recover, 2, base, hosts, opts)
    assert [r["step"] for r in res] == [3, 3] and all(r["exact"] for r in res), res


def test_issue40_item3_latest_step_answers_for_the_whole_job_on_every_rank(tmp_path):
    """With replicas, ``latest_step()`` is the step ``load_latest`` would load, the same on every
    rank: the newest step whose every file has a copy on some host, else the durable tier's."""
    base, hosts = str(tmp_path), ["a", "b", "c"]
    opts = {**OPTS, "durable_every": 2, "keep_fast": 2}
    run_ranks(save_steps, 3, base, hosts, [1, 2, 3], opts)
    assert run_ranks(latest_step, 3, base, hosts, opts) == [[3, "fast"]] * 3
    # every copy of rank 1's file of step 3 (primary on b, replica on c) is gone: step 2, from RAM
    victims = [os.path.join(top, f) for h in ("b", "c") for top, _, files in os.walk(os.path.join(base, "ram", h))
               for f in files if f == "r00001-00.bin" and "step_00000003" in top]  # fmt: skip
    assert len(victims) == 2
    for path in victims:
        os.unlink(path)
    assert run_ranks(latest_step, 3, base, hosts, opts) == [[2, "fast"]] * 3
    os.system(f"rm -rf {base}/ram")  # every host's RAM is gone: the durable tier's step 2
    assert run_ranks(latest_step, 3, base, hosts, opts) == [[2, "durable"]] * 3
    # a durable tier that cannot answer (a 100 KiB `latest` pointer, over the 64 KiB cap; rank 0
    # asks it on a thread of its own beside the inventories' gathering): one error on every rank
    with open(os.path.join(base, "durable", "latest"), "wb") as fh:
        fh.write(b"x" * (100 << 10))
    res = run_ranks(latest_step, 3, base, hosts, opts)
    assert all(r[0] == "error" for r in res) and len({r[1] for r in res}) == 1, res
    assert res[0][1].startswith("IntegrityError: the latest step of the RAM tier is unknown: host a (rank 0): "
                                "SizeLimitError: "), res  # fmt: skip


def test_issue40_item1_a_link_planted_after_construction_is_the_same_error_on_every_rank(tmp_path):
    """Between two saves, the tier open on every rank, host b's folder of host a's replicas
    (``replicas/a``) is swapped for a link to a folder outside holding a canary: step 2's
    replication fails on every rank with the same ConfigurationError naming host b and the link,
    before any transfer (no rank waits for b until the timeout), nothing written through the
    link, the canary and the moved folder untouched."""
    out, link, outside, aside = _plant_a_link(tmp_path, "between_saves")
    assert out[0].startswith("ConfigurationError: step 2 was not replicated (no byte sent"), out[0]
    assert f"host b (rank 1): {link} is a symbolic link" in out[0], out[0]
    assert _files(str(outside)) == {"canary.txt": b"not unickpt's"}
    moved = sorted(_files(str(aside)))  # host a's step 1 replica on b: kept, and nothing of step 2 added
    assert moved and all(n.startswith("step_00000001" + os.sep) for n in moved), moved


def test_issue40_item1_a_link_planted_during_the_transfers_is_the_same_error_on_every_rank(tmp_path):
    """The same link, planted after the check before step 2's replication, as host b starts
    writing its replicas: b's writes are refused (never through the link), its streams still
    run to their end, and every rank raises the same ConfigurationError naming host b and the
    link; no host commits step 2."""
    out, link, outside, _ = _plant_a_link(tmp_path, "during_transfers")
    assert out[0].startswith("ConfigurationError: step 2 was not committed in RAM"), out[0]
    assert f"host b (rank 1): {link} is a symbolic link" in out[0], out[0]
    assert _files(str(outside)) == {"canary.txt": b"not unickpt's"}
    assert not any(os.path.exists(p) for p in _markers(str(tmp_path), "step_00000002"))


def test_issue40_item5_a_link_planted_before_the_durable_commit_is_the_same_error_on_every_rank(tmp_path):
    """Step 2 is due on the durable tier; while the hosts copy their files, rank 0's host's
    metadata of step 2 is swapped for a link to a file outside: rank 0 never reads through it,
    the durable step 2 is not committed, and every rank (not rank 0 alone) raises the same
    ConfigurationError naming host a and the link."""
    out, link, outside, _ = _plant_a_link(tmp_path, "before_durable_commit")
    assert out[0].startswith("ConfigurationError: the commit of step 2's durable copy"), out[0]
    assert f"host a (rank 0): {link} is a symbolic link" in out[0], out[0]
    assert _files(str(outside)) == {"canary.txt": b"not unickpt's"}
    assert not os.path.exists(tmp_path / "durable" / "step_00000002" / META)


def _plant_a_link(tmp_path, when: str) -> tuple[list[str], str, object, object]:
    """``saves_after_a_link_is_planted`` on hosts a, b, c (``when``: which path, when); every
    rank's error (asserted the same, word for word), the link, the outside and the aside paths."""
    base, hosts = str(tmp_path), ["a", "b", "c"]
    outside, aside = tmp_path / "outside", tmp_path / "aside"
    outside.mkdir()
    (outside / "canary.txt").write_text("not unickpt's")
    opts = {**OPTS, "timeout": 30.0, "durable_every": 2}
    victim = "a" if when == "before_durable_commit" else "b"
    target = outside / "canary.txt" if when == "before_durable_commit" else outside
    out = run_ranks(saves_after_a_link_is_planted, 3, base, hosts, opts, victim, when, str(target), str(aside))
    root = os.path.join(base, "ram", victim, f"unickpt-{os.getuid()}", "job")
    link = os.path.join(root, "step_00000002", META) if victim == "a" else os.path.join(root, "replicas", "a")
    assert os.path.islink(link)
    assert len(set(out)) == 1 and out[0], out  # the same error, word for word, on every rank
    return out, link, outside, aside
