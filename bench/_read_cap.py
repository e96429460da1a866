"""A steady disk for the load benchmarks: cap the read rate of this process and its children.

This VM's disk delivers 1.2-3 GB/s from one minute to the next, and a single reader's rate
swings most (one 1 GiB cold read took 0.44-1.7 s in consecutive rounds while four readers
stayed within 0.54-0.86 s). A ratio between two ways of reading the same bytes then says more
about the minute than about the readers. ``read_cap(path, bytes_per_s)`` puts this process in a
block-I/O control group that lets it read at most ``bytes_per_s`` from the disk holding
``path``; every process started inside the ``with`` (rank processes, their helpers) inherits
it. With the cap below what the disk delivers, the disk is a steady bottleneck and a load's
time against the raw read's says how close it runs to the disk's rate.

    with read_cap("/tmp/ckpts", int(1.2e9)) as how:
        ...  # start the rank processes here

Uses cgroup v2 (``io.max``) where the ``io`` controller is available at the root of
``/sys/fs/cgroup``, else cgroup v1 (``blkio.throttle.read_bps_device``). Needs root; the group is
removed on exit and this process moved back where it was. Writes are not capped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["read_cap"]

V2_ROOT = "/sys/fs/cgroup"


def disk_of(path: str) -> str:
    """``major:minor`` of the whole disk holding ``path`` (the cap names a disk, not a partition)."""
    dev = os.stat(path).st_dev
    node = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not os.path.exists(node):
        raise SystemExit(f"--read-cap: {path} is not on a block device (st_dev {os.major(dev)}:{os.minor(dev)})")
    if os.path.exists(os.path.join(node, "partition")):
        node = os.path.join(os.path.realpath(node), "..")
    with open(os.path.join(node, "dev")) as f:
        return f.read().strip()


def _v1_mount() -> str | None:
    with open("/proc/self/mounts") as f:
        for line in f:
            _src, target, fstype, opts = line.split()[:4]
            if fstype == "cgroup" and "blkio" in opts.split(","):
                return target
    return None


def _own_group(controller: str | None) -> str:
    """This process's group: the v1 hierarchy of ``controller``, or the v2 one (None)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _n, ctrls, path = line.rstrip("\n").split(":", 2)
            if (controller is None and ctrls == "") or (controller and controller in ctrls.split(",")):
                return path
    return "/"


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@contextmanager
def read_cap(path: str, bytes_per_s: int) -> Iterator[str]:
    """Reads from ``path``'s disk by this process and its children at most ``bytes_per_s``
    inside the block; yields a description for the report (module docstring)."""
    disk = disk_of(path)
    if os.geteuid() != 0:
        raise SystemExit("--read-cap needs root (it creates a block-I/O control group)")
    try:
        with open(os.path.join(V2_ROOT, "cgroup.controllers")) as f:
            v2 = "io" in f.read().split()
    except OSError:
        v2 = False
    if v2:  # the hierarchy, this process's group in it, the rule's file and text
        top, own = V2_ROOT, _own_group(None)
        rule, text, kind = "io.max", f"{disk} rbps={bytes_per_s}", "cgroup v2 io.max"
        _write(os.path.join(top, "cgroup.subtree_control"), "+io")
    else:
        found = _v1_mount()
        if found is None:
            raise SystemExit("--read-cap: no cgroup v2 io controller and no cgroup v1 blkio hierarchy")
        top, own = found, _own_group("blkio")
        rule, text, kind = "blkio.throttle.read_bps_device", f"{disk} {bytes_per_s}", "cgroup v1 blkio throttle"
    pid = str(os.getpid())
    group, back = os.path.join(top, f"unickpt-bench-{pid}"), os.path.join(top, own.lstrip("/"))
    os.mkdir(group)
    try:
        _write(os.path.join(group, rule), text)
        _write(os.path.join(group, "cgroup.procs"), pid)
        yield f"reads capped at {bytes_per_s / 1e9:.2f} GB/s ({kind} on {disk})"
    finally:  # back where it was, and the group (this function's own) removed
        _write(os.path.join(back, "cgroup.procs"), pid)
        try:
            os.rmdir(group)
        except OSError as e:  # EBUSY: a child outlived the run (run_session kills its ranks' groups)
            print(f"--read-cap: could not remove {group}: {e}")
