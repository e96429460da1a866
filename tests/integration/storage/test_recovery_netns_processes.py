"""Fast recovery (issue 40) on hosts that share neither RAM nor network: three simulated hosts,
each a network namespace (a veth into a bridge of a fourth, "switch", namespace; addresses of
the test's own /24 in 10.0.0.0/8) plus a mount namespace with a private tmpfs as its RAM, each
running one torchrun node (static rendezvous on host a's bridge address, gloo on the veth). A
replica can reach another host only through the tier's process group over that network.

Needs root, ``ip``, ``unshare`` and ``nsenter`` (skipped with the reason otherwise; the two-host
tests' ``_why_not``). Namespaces, links and processes are the test's own and removed at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.integration.storage.test_two_hosts import _why_not

OPTS = {"replicas": 1, "keep_fast": 2, "durable_every": 100, "chunk_bytes": 16384}
META = "unickpt.metadata.json"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class _NetHost:
    """One host: the network namespace ``netns`` (address ``address`` on ``uck0``), and inside it
    a mount namespace holding a private tmpfs on ``ram``, kept alive by a holder process (its
    ranks enter both with ``nsenter``). ``lose()`` ends the mount namespace: the tmpfs is gone;
    the network namespace stays (the host comes back on the same address)."""

    def __init__(self, netns: str, address: str, ram: str) -> None:
        self.netns, self.address, self.ram = netns, address, ram
        self.holder = subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "-m", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs -o size=64m,mode=0700 tmpfs {ram} && echo ready && exec sleep 600"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.holder.stdout is not None and self.holder.stdout.readline().strip() == "ready"

    def enter(self) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-n"]

    def held(self, stepdir: str) -> dict[str, int]:
        """The checkpoint files of ``stepdir`` in this host's RAM (primaries and replicas): name -> size,
        listed from inside its mount namespace."""
        out = subprocess.run([*self.enter(), "find", self.ram, "-type", "f", "-printf", "%P %s\\n"],
                             check=True, capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        held = {}
        for line in out.splitlines():
            rel, size = line.rsplit(" ", 1)
            parts = rel.split("/")
            if stepdir not in parts:
                continue
            name = "/".join(parts[parts.index(stepdir) + 1 :])
            if name == META or (name.startswith("data/") and name.endswith(".bin")):
                held[name] = int(size)
        return held

    def rx_bytes(self) -> int:
        out = subprocess.run(["ip", "netns", "exec", self.netns, "cat", "/sys/class/net/uck0/statistics/rx_bytes"],
                             check=True, capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        return int(out)

    def lose(self) -> None:
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait()


@pytest.fixture
def netns_hosts(tmp_path) -> Iterator[dict[str, _NetHost]]:
    reason = _why_not() or (None if shutil.which("nsenter") else "`nsenter` is not installed")
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    net = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    switch = f"uck-sw-{tag}"
    made: list[str] = []
    names = "abc"
    try:
        for ns in (switch, *(f"uck-{h}-{tag}" for h in names)):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, h in enumerate(names):
            ns, end = f"uck-{h}-{tag}", f"uk{h}{tag}"
            _ip("link", "add", end, "type", "veth", "peer", "name", f"uk{h}s{tag}")
            _ip("link", "set", end, "netns", ns)
            _ip("link", "set", f"uk{h}s{tag}", "netns", switch)
            _ip("-n", switch, "link", "set", f"uk{h}s{tag}", "master", "br0")
            _ip("-n", switch, "link", "set", f"uk{h}s{tag}", "up")
            _ip("-n", ns, "link", "set", end, "name", "uck0")
            _ip("-n", ns, "addr", "add", f"{net}.{i + 1}/24", "dev", "uck0")
            _ip("-n", ns, "link", "set", "uck0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.SubprocessError, OSError) as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        detail = getattr(e, "stderr", "") or str(e)
        pytest.skip(f"this machine forbids network namespaces or bridges: {detail.strip()[:200]}")
    ram = str(tmp_path / "ram-tmpfs")
    os.makedirs(ram)
    hosts: dict[str, _NetHost] = {}
    try:
        for i, h in enumerate(names):
            hosts[h] = _NetHost(f"uck-{h}-{tag}", f"{net}.{i + 1}", ram)
        yield hosts
    finally:
        for host in hosts.values():
            host.lose()
        for ns in made:  # deleting a namespace removes its ends of the veth pairs, and so the pairs
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _torchrun_job(hosts: dict[str, _NetHost], fn: str, args: list, tmp: str) -> list[dict]:
    """One torchrun node per host (node rank = the host's place in ``hosts``), one rank each,
    static rendezvous on host a's address; each rank's JSON result, in rank order."""
    port = 20000 + secrets.randbelow(20000)  # the namespaces are new: every port is free
    names = list(hosts)
    out = os.path.join(tmp, f"{fn}-{port}.json")
    path = os.pathsep.join([REPO, os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")])  # CI sets none
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "uck0",
           "RECOVERY_TEST_RAM": hosts[names[0]].ram, "PYTHONPATH": path}  # fmt: skip
    procs = []
    for node, h in enumerate(names):
        cmd = [*hosts[h].enter(), sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(names)),
               "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", hosts[names[0]].address,
               "--master-port", str(port), "-m", "tests.workers.recovery_workers", fn, "env", out,
               json.dumps([tmp, names, *args])]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO))
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * len(names), codes
    results = []
    for rank in range(len(names)):
        with open(f"{out}.{rank}") as fh:
            results.append(json.load(fh))
    return results


def test_issue40_item2_hosts_in_own_mount_and_network_namespaces_rebuild_a_lost_hosts_ram_over_the_network(
    netns_hosts, tmp_path
):
    """Host b's RAM (its private tmpfs) is lost, b comes back with an empty one on the same
    address, the job restarts at the same size: every byte b loads came from a peer over the
    bridge, bit-exact with the state of the saved step."""
    hosts, tmp = netns_hosts, str(tmp_path)
    _torchrun_job(hosts, "save_steps", [[1, 2], OPTS], tmp)
    assert os.listdir(hosts["a"].ram) == []  # no host's RAM is visible outside its namespace
    held = {h: hosts[h].held("step_00000002") for h in hosts}
    assert all(len(held[h]) > 1 for h in hosts), held
    every = {n: s for h in hosts for n, s in held[h].items()}
    hosts["b"].lose()
    hosts["b"] = _NetHost(hosts["b"].netns, hosts["b"].address, hosts["b"].ram)
    assert hosts["b"].held("step_00000002") == {}
    rx_before = hosts["b"].rx_bytes()
    res = _torchrun_job(hosts, "recover", [OPTS], tmp)
    assert [r["step"] for r in res] == [2, 2, 2] and all(r["exact"] for r in res), res
    assert all(r["unickpt"].startswith(os.path.join(REPO, "src")) for r in res), res[0]["unickpt"]
    # b fetches the metadata it lacks; b's rank reads its file from c (its replica holder) and, as
    # c's does, the bias in rank 0's file from a (recovery.feed): one pass, nothing rebuilt but b's
    # own file, written back into b's new tmpfs after the load
    own = [{n: s for n, s in every.items() if os.path.basename(n).startswith(f"r0000{i}-")} for i in range(3)]
    r0, r1, r2 = (sum(o.values()) for o in own)
    own_b = own[1]
    assert res[0]["tier"] == "ram" and res[0]["failed"] == [], res[0]
    assert res[0]["bytes"]["local"] == r0 + r2 + 2 * every[META], res[0]
    by_host = res[0]["peer_by_host"]
    assert by_host["c"] == r1 + every[META] and 0 < by_host["a"] <= 2 * r0, res[0]
    assert res[0]["bytes"]["peer"] == sum(by_host.values()) == r1 + every[META] + by_host["a"]
    assert hosts["b"].held("step_00000002") == {**own_b, META: every[META]}
    # b's file crossed b's veth twice (into the state, then into its RAM), the metadata once
    assert hosts["b"].rx_bytes() - rx_before >= 2 * r1 + every[META]


def test_issue40_item3_a_lost_hosts_rank_reads_its_file_from_a_holder_over_the_network_then_it_is_written_back(
    netns_hosts, tmp_path
):
    """The same hosts, a state every rank's load finds on its own host (no value saved by one rank
    for all): after b's RAM is lost, b's rank reads its file from its holder over the bridge
    straight into the state (``recovery.feed``), and the file is then written back into b's new
    tmpfs in the background, crossing the network a second time."""
    hosts, tmp = netns_hosts, str(tmp_path)
    _torchrun_job(hosts, "save_steps", [[1], OPTS, False], tmp)
    held = {h: hosts[h].held("step_00000001") for h in hosts}
    own_b = {n: s for n, s in held["b"].items() if os.path.basename(n).startswith("r00001-")}
    assert len(own_b) == 1, held["b"]
    hosts["b"].lose()
    hosts["b"] = _NetHost(hosts["b"].netns, hosts["b"].address, hosts["b"].ram)
    rx_before = hosts["b"].rx_bytes()
    res = _torchrun_job(hosts, "recover", [OPTS, False], tmp)
    assert [r["step"] for r in res] == [1, 1, 1] and all(r["exact"] for r in res), res
    assert res[0]["tier"] == "ram" and res[0]["failed"] == [], res[0]
    assert res[0]["fed"] == sum(own_b.values()), res[0]
    assert hosts["b"].held("step_00000001") == {**own_b, META: held["b"][META]}
    assert hosts["b"].rx_bytes() - rx_before >= 2 * sum(own_b.values())
