"""Two simulated hosts on this machine: each is a network namespace (a veth pair between them,
addresses of the test's own /24 in 10.0.0.0/8) plus a UTS namespace (its own host name); the
ranks of one host run inside it, gloo talks over the veth pair, and the checkpoint folder is
the one file system both see (a shared NAS, for these ranks).

What this exercises that one host cannot:
- the load's "ranks share one host's page cache" decision: ranks on two hosts do not, so the
  automatic deduplication reads every saved shard once, on one rank, and forwards it over the
  process group (bytes read by all ranks together == the checkpoint's data bytes);
- the save lock across hosts: a lock left by a coordinator killed on host A cannot be judged by
  its pid from host B, so a new job there refuses with the holder's host named, and the
  committed checkpoint is untouched.

Needs root, ``ip`` and ``unshare`` (skipped with the reason otherwise). Namespaces, links and
processes are the test's own and removed at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

import unickpt
from tests import workers
from unickpt.format import decode_metadata
from unickpt.format.records import METADATA_FILE
from unickpt.testing.toy import build

WORKER = os.path.join(os.path.dirname(os.path.abspath(workers.__file__)), "twohost_worker.py")
_TIMEOUT_S = 240.0


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class Host:
    netns: str
    name: str
    address: str


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    net = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    hosts = (Host(f"uck-a-{tag}", "unickpt-host-a", f"{net}.1"), Host(f"uck-b-{tag}", "unickpt-host-b", f"{net}.2"))
    made: list[str] = []
    try:
        for h in hosts:
            _run("ip", "netns", "add", h.netns)
            made.append(h.netns)
        _run("ip", "link", "add", f"uka{tag}", "type", "veth", "peer", "name", f"ukb{tag}")
        for h, end in zip(hosts, (f"uka{tag}", f"ukb{tag}")):
            _run("ip", "link", "set", end, "netns", h.netns)
            _run("ip", "-n", h.netns, "link", "set", end, "name", "uck0")
            _run("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "uck0")
            _run("ip", "-n", h.netns, "link", "set", "uck0", "up")
            _run("ip", "-n", h.netns, "link", "set", "lo", "up")
    except (subprocess.SubprocessError, OSError) as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        detail = getattr(e, "stderr", "") or str(e)
        pytest.skip(f"this machine forbids network namespaces: {detail.strip()[:200]}")
    try:
        yield hosts
    finally:
        for ns in made:  # deleting a namespace removes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_on_hosts(placement: list[Host], scenario: str, ckpt: str, tmp: str, master: Host) -> list[dict | None]:
    """Start rank r of ``len(placement)`` inside ``placement[r]``; wait for all (bounded); each
    rank's JSON report, or None for a rank that died (its exit code is then in the report list's
    place as ``{"exitcode": c}``)."""
    port = 20000 + secrets.randbelow(20000)  # the master's namespace is new: every port is free
    procs, outs = [], []
    for rank, host in enumerate(placement):
        out = os.path.join(tmp, f"{scenario}-{rank}.json")
        outs.append(out)
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=master.address,
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(len(placement)),
            GLOO_SOCKET_IFNAME="uck0",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        )
        script = f'hostname {host.name} && exec "$0" "$@"'
        cmd = ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c", script]
        procs.append(subprocess.Popen([*cmd, sys.executable, WORKER, scenario, ckpt, out], env=env))
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=_TIMEOUT_S))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports: list[dict | None] = []
    for code, out in zip(codes, outs):
        if code == 0 and os.path.exists(out):
            with open(out) as f:
                reports.append(json.load(f))
        else:
            reports.append({"exitcode": code})
    return reports


def _scenario(reports: list[dict | None], name: str) -> list[dict | None]:
    """One scenario's reports out of a ``loads`` job (a rank that died keeps its exit code)."""
    return [r[name] if r is not None and "exitcode" not in r else r for r in reports]


def _data_bytes(ckpt: str) -> tuple[int, int]:
    """The bytes of the saved tensors, and of the data files (padding and blobs included)."""
    with open(os.path.join(ckpt, METADATA_FILE), "rb") as f:
        md = decode_metadata(f.read())
    files = sum(os.path.getsize(os.path.join(ckpt, name)) for name in md.files)
    return sum(s.byte_length for t in md.tensors.values() for s in t.shards), files


def _check_loaded(reports: list[dict | None], hosts: list[Host]) -> int:
    """Every rank bit-exact with the same next loss; the bytes all ranks read together."""
    assert all(r is not None and "exitcode" not in r for r in reports), reports
    assert [r["host"] for r in reports] == [h.name for h in hosts]
    for rank, r in enumerate(reports):
        assert r["mismatched"] == [], f"rank {rank}: {r['mismatched'][:5]}"
        assert r["loss_equal"] and r["step"] == 2, r
    return sum(r["read_bytes"] for r in reports)


def test_issue14_two_hosts_zero_redundancy_resharding_load(two_hosts, tmp_path):
    """Saved by 4 ranks on two hosts (4 KiB checksum chunks), loaded by 3. FSDP2 at 3 across
    hosts: each rank needs other rows of the boundary shards than its neighbour, so it reads just
    its own rows (plus the chunks at their edges), and small shards that several ranks need are
    read once and forwarded: the ranks read the checkpoint's bytes about once; on one host they
    read what they need through the shared page cache instead. A replicated (DDP) load at 3, where
    every rank needs every byte: across hosts the automatic choice forwards, so every byte is read
    once; on one host each rank reads all of it through the shared page cache (the device still
    delivers each byte once)."""
    a, b = two_hosts
    ckpt = str(tmp_path / "ckpt")
    saved = run_on_hosts([a, a, b, b], "save", ckpt, str(tmp_path), master=a)
    assert [r["host"] for r in saved] == [a.name, a.name, b.name, b.name], saved
    stored, files = _data_bytes(ckpt)
    edges = 2 * 4096 * 4 * 3  # a chunk at each end of each saved file's part, for each loading rank
    # each placement loads twice in one job: FSDP2 (zero redundancy), then DDP (replicated)
    across_job = run_on_hosts([a, b, b], "loads", ckpt, str(tmp_path), master=a)
    local_job = run_on_hosts([a, a, a], "loads", ckpt, str(tmp_path), master=a)
    across = _check_loaded(_scenario(across_job, "load"), [a, b, b])
    assert stored <= across <= stored + edges, (across, stored)
    # one host: small tensors that share a chunk are read by each rank needing a part of them,
    # through the page cache, instead of being forwarded
    one_host = _check_loaded(_scenario(local_job, "load"), [a, a, a])
    assert one_host >= across, (one_host, across)
    spread = _scenario(across_job, "load_replicated")
    local = _scenario(local_job, "load_replicated")
    for reports in (spread, local):
        assert all(r is not None and "exitcode" not in r and r["mismatched"] == [] for r in reports), reports
    assert files <= sum(r["read_bytes"] for r in spread) <= files + 2 * 4096 * 12, spread
    assert sum(r["moved_bytes"] for r in spread) > 0  # forwarded between the hosts
    assert sum(r["read_bytes"] for r in local) == 3 * files and sum(r["moved_bytes"] for r in local) == 0


def test_issue14_save_lock_of_a_dead_coordinator_on_another_host_is_not_broken_blindly(two_hosts, tmp_path):
    a, b = two_hosts
    ckpt = str(tmp_path / "ckpt")
    crashed = run_on_hosts([a, b], "crash_in_commit", ckpt, str(tmp_path), master=a)
    assert crashed[0] == {"exitcode": -9}, crashed  # SIGKILLed entering the metadata publication
    assert crashed[1] is not None and "survived" not in crashed[1], crashed  # never a success
    # a new job on host B: the lock's holder is on host A, where its pid cannot be looked up
    again = run_on_hosts([b], "save_again", ckpt, str(tmp_path), master=b)
    assert again[0]["error"] == "ConcurrentSaveError", again
    assert f"on host {a.name}" in again[0]["msg"] and "another save is in progress" in again[0]["msg"], again
    # the committed step 1 is untouched (loaded here, on the real host)
    model, optim = build("torch", seed=77)
    state = {"model": model, "optimizer": optim, "extra_state": None}
    unickpt.load(ckpt, state, framework="torch")
    assert state["extra_state"] == {"step": 1}
