"""The storage contract: the tests every backend passes (``storage.base`` states the contract).

Use it by subclassing ``StorageContract`` in a test module and giving the ``backend`` fixture::

    class TestMyBackendContract(StorageContract):
        @pytest.fixture
        def backend(self, tmp_path):
            return lambda root: MyStorage(f"{tmp_path}/{root}")

``backend(root)`` returns a *new* storage object rooted at ``root`` (a short relative name);
the same ``root`` must reach the same objects (two instances stand for two processes), a new
``root`` an empty location. Optional fixture: ``make_link(storage, name, target)`` plants a
symbolic link (None where the backend has no links: those tests skip). Tests gated on a
capability skip on backends that do not declare it.

The tests are plain methods taking the factory, so a test can also call one directly on a
deliberately broken backend and expect it to fail (``test_contract_catches_broken.py``).
Everything is small and bounded: no sleeps, threads joined with deadlines.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from unickpt.errors import (
    CheckpointError,
    MissingDataFileError,
    SizeLimitError,
    StorageError,
    TransientStorageError,
    TruncatedDataFileError,
    UnsafePathError,
)
from unickpt.folder.publish import Publisher, PutPublisher, RenamePublisher, publisher_for
from unickpt.storage import open_storage
from unickpt.storage.base import SMALL_FILE_LIMIT, Storage, StorageCapabilities, exists_error
from unickpt.storage.memory import CAPABILITIES as MEMORY_CAPABILITIES
from unickpt.storage.memory import MemoryStorage
from unickpt.storage.retry import RetryingStorage, RetryPolicy

__all__ = ["StorageContract", "Backend", "Flaky", "NoReplaceRename", "publishers", "pattern"]

Backend = Callable[[str], Storage]
_DEADLINE_S = 60.0
_NO_WAIT = RetryPolicy(max_attempts=4, initial_delay_s=0.0, jitter=0.0)


def pattern(n: int, seed: int) -> bytes:
    """``n`` pseudo-random bytes (reproducible)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def publishers(storage: Storage) -> list[Publisher]:
    """Every publication strategy ``storage``'s capabilities allow (both where it has both)."""
    caps = storage.capabilities
    out: list[Publisher] = []
    if caps.atomic_put:
        out.append(PutPublisher(storage))
    if caps.atomic_rename:
        out.append(RenamePublisher(storage))
    return out


def _run_threads(targets: Sequence[Callable[[], None]]) -> list[BaseException]:
    """Run ``targets`` in threads started together; the exceptions they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                start.wait(_DEADLINE_S)
                fn()
            except BaseException as e:
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a storage call hung"
    return errors


def _create_race(creators: Sequence[Storage | Publisher], name: str) -> list[int]:
    """Creator ``i`` (a storage or a publisher) tries to create ``name`` holding
    ``creator-<i>``, all at once; the indexes of those told they created it."""
    won: list[int] = []

    def create(i: int) -> Callable[[], None]:
        def run() -> None:
            c = creators[i]
            data = f"creator-{i}".encode()
            ok = (
                c.create(name, data)
                if isinstance(c, (PutPublisher, RenamePublisher))
                else c.create_exclusive(name, data)
            )
            if ok:
                won.append(i)

        return run

    assert _run_threads([create(i) for i in range(len(creators))]) == []
    return sorted(won)


def _publish_while_reading(publisher: Publisher, reader: Publisher, target: str, versions: list[bytes]) -> list[str]:
    """Publish ``versions`` in order while ``reader`` (the same strategy on another storage
    object) reads ``target`` in a loop; what it saw that was not a whole version in order
    (nothing when publication is atomic)."""
    index = {v: i for i, v in enumerate(versions)}
    done = threading.Event()
    seen: list[int] = []
    bad: list[str] = []

    def read_loop() -> None:
        while not done.is_set() and len(bad) < 3:
            data = reader.read(target)
            if data is None:
                if seen:
                    bad.append("the object vanished after it was published")
                continue
            i = index.get(data)
            if i is None:
                bad.append(f"a torn object of {len(data)} bytes")
            elif seen and i < seen[-1]:
                bad.append(f"version {i} after version {seen[-1]}")
            else:
                seen.append(i)

    def write_all() -> None:
        try:
            for v in versions:
                publisher.publish(target, v)
        finally:
            done.set()

    assert _run_threads([read_loop, write_all]) == []
    return bad


class Flaky:
    """Wraps a backend: the next calls of an op fail as planned (``fail(op, *modes)``):
    ``"before"`` a transient error with no effect, ``"after"`` the call lands and then its reply
    is lost (transient), ``"permanent"`` EACCES with no effect, ``"ok"`` passes (to fail a later
    call). Implements the protocol only."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.url, self.capabilities = inner, inner.url, inner.capabilities
        self.plan: dict[str, list[str]] = {}
        self.calls: dict[str, int] = {}

    def fail(self, op: str, *modes: str) -> Flaky:
        self.plan.setdefault(op, []).extend(modes)
        return self

    def _call(self, op: str, fn: Callable[[], Any]) -> Any:
        self.calls[op] = self.calls.get(op, 0) + 1
        mode = self.plan[op].pop(0) if self.plan.get(op) else "ok"
        if mode == "before":
            raise TimeoutError(f"injected timeout before {op}")
        if mode == "permanent":
            raise PermissionError(errno.EACCES, f"injected: permission denied in {op}")
        out = fn()
        if mode == "after":
            raise TransientStorageError(errno.ETIMEDOUT, f"injected: the reply of {op} was lost")
        return out

    def write(self, name: str, parts: Sequence[Any]) -> None:
        self._call("write", lambda: self.inner.write(name, parts))

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._call("read_into", lambda: self.inner.read_into(name, offset, out))

    def read_into_cached(self, name: str, offset: int, out: memoryview) -> None:
        self._call("read_into_cached", lambda: self.inner.read_into_cached(name, offset, out))

    def read(self, name: str, limit: int = 1 << 30) -> bytes | None:
        return self._call("read", lambda: self.inner.read(name, limit))

    def size(self, name: str) -> int | None:
        return self._call("size", lambda: self.inner.size(name))

    def list(self, prefix: str = "") -> list[str]:
        return self._call("list", lambda: self.inner.list(prefix))

    def delete(self, names: Sequence[str]) -> None:
        self._call("delete", lambda: self.inner.delete(names))

    def put(self, name: str, data: bytes) -> None:
        self._call("put", lambda: self.inner.put(name, data))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        return self._call("create_exclusive", lambda: self.inner.create_exclusive(name, data))

    def update_exclusive(self, name: str, expected: bytes, data: bytes) -> bool:
        return self._call("update_exclusive", lambda: self.inner.update_exclusive(name, expected, data))

    def rename(self, src: str, dst: str) -> None:
        self._call("rename", lambda: self.inner.rename(src, dst))

    def sync(self, folder: str = "") -> None:
        self._call("sync", lambda: self.inner.sync(folder))


class NoReplaceRename(MemoryStorage):
    """A memory-backed stand-in for a file system whose rename cannot replace (HDFS's plain
    rename): no atomic put, ``rename`` refuses an existing target."""

    capabilities = dataclasses.replace(MEMORY_CAPABILITIES, atomic_put=False, rename_replaces=False)

    def rename(self, src: str, dst: str) -> None:
        if self.size(dst) is not None:
            raise exists_error(f"{self.url}/{dst}")
        super().rename(src, dst)


class StorageContract:
    """The contract's tests (see the module docstring). Not collected itself (no ``Test``
    prefix); subclasses are."""

    @pytest.fixture
    def make_link(self) -> Callable[[Storage, str, str], None] | None:
        return None

    # ------------------------------------------------------------------ the record

    def test_capabilities_are_one_frozen_record(self, backend: Backend) -> None:
        s = backend("caps")
        caps = s.capabilities
        assert isinstance(caps, StorageCapabilities) and isinstance(s, Storage)
        assert backend("caps").capabilities == caps  # stated once per backend, not per call
        with pytest.raises(dataclasses.FrozenInstanceError):
            caps.atomic_put = not caps.atomic_put  # type: ignore[misc]
        assert caps.atomic_put or caps.atomic_rename, "no way to publish atomically"
        assert publishers(s), caps
        assert isinstance(s.url, str) and s.url

    # ------------------------------------------------------------------ data files

    def test_write_then_read_back_every_kind_of_part(self, backend: Backend) -> None:
        s = backend("rw")
        big = pattern((3 << 20) + 5, 1)  # large enough for a backend's direct/multipart path
        unaligned = np.frombuffer(pattern(10_001, 2), dtype=np.uint8)[3:]
        cases: dict[str, list[Any]] = {
            "empty.bin": [],
            "zero-parts.bin": [b"", bytearray()],
            "a/b/mixed.bin": [b"head", bytearray(b"-mid-"), memoryview(unaligned), b"", memoryview(b"tail")],
            "big.bin": [memoryview(big)[:12345], memoryview(big)[12345:]],
        }
        for name, parts in cases.items():
            s.write(name, parts)
        other = backend("rw")  # another instance (process) on the same root sees them
        for name, parts in cases.items():
            want = b"".join(bytes(p) for p in parts)
            assert other.size(name) == len(want), name
            assert other.read(name) == want, name
            out = bytearray(len(want))
            other.read_into(name, 0, memoryview(out))
            assert bytes(out) == want, name

    @pytest.mark.parametrize("cached", [False, True], ids=["read_into", "read_into_cached"])
    def test_ranged_reads_at_any_offset_and_length(self, backend: Backend, cached: bool) -> None:
        s = backend("ranges")
        n = (2 << 20) + 12_345
        data = pattern(n, 3)
        s.write("f.bin", [data])
        read = s.read_into_cached if cached else s.read_into
        rng = random.Random(4)
        cases = [(0, 0), (n, 0), (0, n), (1, 1), (4095, 4097), (4096, 8192), (n - 1, 1), (n - 4097, 4097)]
        cases += [(o, rng.randrange(0, n - o + 1)) for o in (rng.randrange(n) for _ in range(12))]
        cases += [(rng.randrange(n - (1 << 20)), (1 << 20) + rng.randrange(5000)) for _ in range(3)]
        for offset, length in cases:
            for phase in (0, 3):  # destination at an arbitrary (unaligned) address too
                buf = bytearray(length + phase)
                read("f.bin", offset, memoryview(buf)[phase : phase + length])
                assert bytes(buf[phase:]) == data[offset : offset + length], (offset, length, phase)

    @pytest.mark.parametrize("cached", [False, True], ids=["read_into", "read_into_cached"])
    def test_reads_past_the_end_or_of_missing_objects_fail_precisely(self, backend: Backend, cached: bool) -> None:
        s = backend("past-end")
        s.write("d/short.bin", [b"0123456789"])
        read = s.read_into_cached if cached else s.read_into
        for offset, length in ((5, 6), (10, 1), (100, 1), (0, 11)):
            with pytest.raises(TruncatedDataFileError, match="short.bin"):
                read("d/short.bin", offset, memoryview(bytearray(length)))
        with pytest.raises(MissingDataFileError, match="nope.bin"):
            read("d/nope.bin", 0, memoryview(bytearray(1)))

    def test_missing_names_are_values(self, backend: Backend) -> None:
        s = backend("missing")
        assert s.read("nope") is None and s.size("nope") is None and s.list() == [] and s.list("nope/") == []
        s.delete(["nope", "a/b/nope"])  # ignored
        s.delete([])
        assert s.update_exclusive("nope", b"x", b"y") is False and s.size("nope") is None
        s.sync("")
        s.sync("no/such/folder")
        s.write("d/x.bin", [b"1"])
        assert s.size("d") is None and s.read("d") is None  # a folder is not a name
        if s.capabilities.atomic_rename:
            with pytest.raises(StorageError) as ei:
                s.rename("nope", "other")
            assert ei.value.errno == errno.ENOENT and "nope" in str(ei.value)
            assert s.size("other") is None

    def test_write_never_replaces_an_existing_name(self, backend: Backend) -> None:
        s = backend("exclusive-write")
        s.write("f.bin", [b"first"])
        assert s.create_exclusive("c.bin", b"created")
        for name in ("f.bin", "c.bin"):
            before = s.read(name)
            with pytest.raises(UnsafePathError) as ei:
                s.write(name, [b"second"])
            assert ei.value.errno == errno.EEXIST and name in str(ei.value)
            assert s.read(name) == before

    # ------------------------------------------------------------------ names

    def test_list_is_a_sorted_recursive_string_prefix_match(self, backend: Backend) -> None:
        s = backend("listing")
        names = ["a/b/c.bin", "a/b1.bin", "a/bc/d.bin", "ab.bin", "z.bin", "a/b/e/f.bin", "unickpt.x"]
        for n in names:
            s.write(n, [n.encode()])
        assert s.list() == sorted(names) == s.list("")
        assert s.list("a/b") == ["a/b/c.bin", "a/b/e/f.bin", "a/b1.bin", "a/bc/d.bin"]
        assert s.list("a/b/") == ["a/b/c.bin", "a/b/e/f.bin"]
        assert s.list("a/b1") == ["a/b1.bin"] and s.list("unickpt.") == ["unickpt.x"]
        assert s.list("q") == [] and s.list("a/b/e/f.bin") == ["a/b/e/f.bin"]

    def test_delete_removes_exactly_the_names_given(self, backend: Backend) -> None:
        s = backend("delete")
        names = ["d/1.bin", "d/2.bin", "d/sub/3.bin", "e.bin"]
        for n in names:
            s.write(n, [b"x"])
        s.delete(["d/1.bin", "d/sub/3.bin", "d/missing.bin"])
        assert s.list() == ["d/2.bin", "e.bin"]
        s.delete(["d/2.bin", "e.bin"])
        assert s.list() == []
        s.write("d/1.bin", [b"again"])  # a name deleted can be created again
        assert s.read("d/1.bin") == b"again"

    @pytest.mark.parametrize("bad", ["../x", "/abs", "a/../../x", "a//b", "./a", "a/./b", "", "a/", "a\\..\\b"])
    def test_names_escaping_the_root_are_refused(self, backend: Backend, bad: str) -> None:
        s = backend("escape")
        s.write("inside/ok.bin", [b"ok"])
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("write", lambda: s.write(bad, [b"x"])),
            ("read", lambda: s.read(bad)),
            ("read_into", lambda: s.read_into(bad, 0, memoryview(bytearray(1)))),
            ("read_into_cached", lambda: s.read_into_cached(bad, 0, memoryview(bytearray(1)))),
            ("size", lambda: s.size(bad)),
            ("delete", lambda: s.delete([bad])),
            ("put", lambda: s.put(bad, b"x")),
            ("create_exclusive", lambda: s.create_exclusive(bad, b"x")),
            ("update_exclusive", lambda: s.update_exclusive(bad, b"x", b"y")),
        ]
        if s.capabilities.atomic_rename:
            calls += [
                ("rename from", lambda: s.rename(bad, "inside/y")),
                ("rename to", lambda: s.rename("inside/ok.bin", bad)),
            ]
        for op, call in calls:
            with pytest.raises(StorageError) as ei:
                call()
            assert ei.value.errno == errno.EINVAL, (op, ei.value)
        if bad.startswith(("../", "/", "./", "a/../")) or bad == "a\\..\\b":
            with pytest.raises(StorageError):
                s.list(bad)
        assert s.list() == ["inside/ok.bin"] and s.read("inside/ok.bin") == b"ok"

    # ------------------------------------------------------------------ small objects

    def test_small_reads_are_capped(self, backend: Backend) -> None:
        s = backend("caps-on-reads")
        s.write("p", [b"x" * 100])
        assert s.read("p", limit=100) == b"x" * 100
        with pytest.raises(SizeLimitError, match="99"):
            s.read("p", limit=99)
        s.write("big", [bytes(SMALL_FILE_LIMIT + 1)])
        with pytest.raises(SizeLimitError, match=str(SMALL_FILE_LIMIT)):
            s.read("big", SMALL_FILE_LIMIT)

    def test_put_creates_and_replaces_whole_objects(self, backend: Backend) -> None:
        s = backend("put")
        s.put("a/p", b"long first version")
        s.put("a/p", b"short")
        assert s.read("a/p") == b"short" and s.size("a/p") == 5
        s.put("a/p", b"")
        assert s.read("a/p") == b""

    def test_exclusive_create_has_exactly_one_winner(self, backend: Backend) -> None:
        """Eight creators (each its own storage object, as separate processes would be) race
        for one name, five times: exactly one wins each race, and the object holds its bytes."""
        for race in range(5):
            name = f"locks/lock.{race}"
            winners = _create_race([backend("race") for _ in range(8)], name)
            assert len(winners) == 1, f"race {race}: {len(winners)} creators won: {winners}"
            assert backend("race").read(name) == f"creator-{winners[0]}".encode()
        s = backend("race")
        assert s.create_exclusive("locks/lock.0", b"late") is False
        assert s.read("locks/lock.0") != b"late"

    def test_update_exclusive_is_a_compare_and_swap(self, backend: Backend) -> None:
        s = backend("cas")
        assert s.create_exclusive("l", b"v1")
        assert s.update_exclusive("l", b"v1", b"v2 longer") is True and s.read("l") == b"v2 longer"
        assert s.update_exclusive("l", b"v1", b"v3") is False and s.read("l") == b"v2 longer"
        assert s.update_exclusive("l", b"v2 longer", b"v4") is True and s.read("l") == b"v4"
        s.delete(["l"])
        assert s.update_exclusive("l", b"v4", b"v5") is False and s.size("l") is None  # never recreated

    def test_rename_moves_in_one_step(self, backend: Backend) -> None:
        s = backend("rename")
        s.write("a/src", [b"new"])
        if not s.capabilities.atomic_rename:
            with pytest.raises(StorageError) as ei:
                s.rename("a/src", "b/dst")
            assert s.read("a/src") == b"new"
            pytest.skip(f"no rename ({ei.value})")
        s.rename("a/src", "b/dst")
        assert s.size("a/src") is None and s.read("b/dst") == b"new"
        s.write("a/src2", [b"newer"])
        if s.capabilities.rename_replaces:
            s.rename("a/src2", "b/dst")
            assert s.read("b/dst") == b"newer" and s.size("a/src2") is None
        else:
            with pytest.raises(StorageError) as ei:
                s.rename("a/src2", "b/dst")
            assert ei.value.errno == errno.EEXIST
            assert s.read("b/dst") == b"new" and s.read("a/src2") == b"newer"

    # ------------------------------------------------------------------ publication (folder.publish)

    def test_publish_is_atomic_for_readers(self, backend: Backend) -> None:
        """A reader in a loop (another storage object, reading through the publisher as the
        engine does) never sees a torn, empty or vanished object while a writer publishes
        versions of different sizes: only whole versions, in order (old or new). Every strategy
        the backend's capabilities allow."""
        for publisher in publishers(backend("publish")):
            target = f"{type(publisher).__name__}/unickpt.metadata.json"
            versions = [(b"%04d|" % i) + pattern(1 + (i * 7919) % 200_000, i) for i in range(40)]
            reader = type(publisher)(backend("publish"))
            bad = _publish_while_reading(publisher, reader, target, versions)
            assert bad == [], f"{publisher}: {bad}"
            assert backend("publish").read(target) == versions[-1]

    def test_publish_leaves_no_temporaries_and_names_its_leftovers(self, backend: Backend) -> None:
        """After publications only the targets are listed; a publication interrupted before its
        last step leaves only names its publisher recognises as its own leftovers, and a user's
        look-alike is never one."""
        s = backend("leftovers")
        for publisher in publishers(s):
            base = f"{type(publisher).__name__}/"
            for target in (base + "meta.json", base + "deep/er/latest"):
                publisher.publish(target, b"one")
                publisher.publish(target, b"two")
                assert publisher.leftovers(target) == []
            assert s.list(base) == [base + "deep/er/latest", base + "meta.json"]
            decoy = base + "meta.json.tmp-user-notes"
            s.write(decoy, [b"keep"])
            assert not publisher.is_leftover(decoy, base + "meta.json")
            assert publisher.leftovers(base + "meta.json") == []
            # interrupted: the last step fails and the cleanup of the temporary fails too
            flaky = Flaky(s).fail("rename", "permanent").fail("put", "permanent").fail("delete", "permanent")
            with pytest.raises(OSError):
                type(publisher)(flaky).publish(base + "meta.json", b"three")
            assert s.read(base + "meta.json") == b"two"
            left = publisher.leftovers(base + "meta.json")
            extra = sorted(set(s.list(base)) - {base + "meta.json", base + "deep/er/latest", decoy})
            assert left == extra, (left, extra)
            assert all(publisher.is_leftover(n, base + "meta.json") for n in left)
            s.delete(left)

    def test_publisher_create_is_exclusive(self, backend: Backend) -> None:
        s = backend("pub-create")
        for publisher in publishers(s):
            name = f"{type(publisher).__name__}/unickpt.save.lock.1"
            winners = _create_race([publisher] * 6, name)
            assert len(winners) == 1, winners
            assert s.read(name) == f"creator-{winners[0]}".encode()
            assert s.list(f"{type(publisher).__name__}/") == [name]

    def test_publisher_for_picks_from_the_capabilities(self, backend: Backend) -> None:
        s = backend("pick")
        chosen = publisher_for(s)
        assert isinstance(chosen, PutPublisher if s.capabilities.atomic_put else RenamePublisher)

    # ------------------------------------------------------------------ capability-gated

    def test_links_inside_the_root_are_never_followed(
        self, backend: Backend, make_link: Callable[[Storage, str, str], None] | None, tmp_path: Any
    ) -> None:
        if make_link is None:
            pytest.skip("this backend has no links")
        s = backend("links")
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "secret.bin").write_bytes(b"secret")
        make_link(s, "file-link.bin", str(outside / "secret.bin"))
        make_link(s, "dir-link", str(outside))
        for call in (
            lambda: s.read("file-link.bin"),
            lambda: s.read_into("file-link.bin", 0, memoryview(bytearray(1))),
            lambda: s.write("file-link.bin", [b"x"]),
            lambda: s.write("dir-link/new.bin", [b"x"]),
            lambda: s.put("file-link.bin", b"x"),
            # issue 26 item 5: a folder link is refused for reads too, not only the file's own link
            lambda: s.read("dir-link/secret.bin"),
            lambda: s.read_into("dir-link/secret.bin", 0, memoryview(bytearray(1))),
            lambda: s.read_into_cached("dir-link/secret.bin", 0, memoryview(bytearray(1))),
            lambda: s.size("dir-link/secret.bin"),
        ):
            with pytest.raises(UnsafePathError):
                call()
        assert s.create_exclusive("file-link.bin", b"x") is False
        assert "dir-link/secret.bin" not in s.list()
        s.delete(["dir-link/secret.bin", "file-link.bin"])  # the link goes, never its target
        assert (outside / "secret.bin").read_bytes() == b"secret" and sorted(p.name for p in outside.iterdir()) == [
            "secret.bin"
        ]

    def test_a_shared_page_cache_serves_other_processes(self, backend: Backend) -> None:
        """Where ``shared_page_cache`` is declared, ranks of one host read bytes another process
        wrote through ``read_into_cached`` (the engine relies on it instead of forwarding):
        checked from a forked process opening the same URL."""
        s = backend("shared")
        if not s.capabilities.shared_page_cache:
            pytest.skip("no cache shared between processes")
        data = pattern(100_000, 5)
        s.write("f.bin", [data])
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery, exit without cleanup
            code = 1
            try:
                buf = bytearray(len(data) - 17)
                open_storage(s.url).read_into_cached("f.bin", 17, memoryview(buf))
                os.write(wfd, hashlib.sha256(buf).digest())
                code = 0
            finally:
                os._exit(code)
        os.close(wfd)
        try:
            got = os.read(rfd, 64)
        finally:
            os.close(rfd)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert got == hashlib.sha256(data[17:]).digest()

    # ------------------------------------------------------------------ the retry wrapper over it

    def _retrying(self, backend: Backend, root: str) -> tuple[RetryingStorage, Flaky, Storage]:
        inner = backend(root)
        flaky = Flaky(inner)
        return RetryingStorage(flaky, _NO_WAIT, sleep=lambda _: None), flaky, inner

    def test_retry_repeats_idempotent_operations_after_transient_errors(self, backend: Backend) -> None:
        r, flaky, inner = self._retrying(backend, "retry-idem")
        inner.write("f.bin", [b"0123456789"])
        for op in ("read", "read_into", "read_into_cached", "size", "list", "delete", "put", "sync"):
            flaky.fail(op, "before", "after")
        assert r.read("f.bin") == b"0123456789"
        out = bytearray(4)
        r.read_into("f.bin", 3, memoryview(out))
        r.read_into_cached("f.bin", 3, memoryview(out))
        assert bytes(out) == b"3456"
        assert r.size("f.bin") == 10 and r.list("f") == ["f.bin"]
        r.put("p", b"v")
        r.sync("")
        r.delete(["f.bin"])
        assert inner.size("f.bin") is None and inner.read("p") == b"v"
        assert all(flaky.calls[op] == 3 for op in ("read", "size", "list", "delete", "put", "sync")), flaky.calls

    def test_retry_never_repeats_a_non_idempotent_step_blindly(self, backend: Backend) -> None:
        """Each step lands and then its reply is lost: the repeat must recognise its own effect
        (success), and a real conflict must stay one."""
        r, flaky, inner = self._retrying(backend, "retry-once")
        flaky.fail("write", "after")
        r.write("d/a.bin", [b"abc", b"def"])
        assert inner.read("d/a.bin") == b"abcdef"
        inner.write("d/theirs.bin", [b"theirs"])
        flaky.fail("write", "before")
        with pytest.raises(UnsafePathError):
            r.write("d/theirs.bin", [b"minexx"])  # same size, other bytes: not ours
        flaky.fail("create_exclusive", "after")
        assert r.create_exclusive("lock", b"token-A") is True
        flaky.fail("create_exclusive", "before")
        assert r.create_exclusive("lock", b"token-B") is False and inner.read("lock") == b"token-A"
        flaky.fail("update_exclusive", "after")
        assert r.update_exclusive("lock", b"token-A", b"token-A2") is True
        flaky.fail("update_exclusive", "before")
        assert r.update_exclusive("lock", b"token-A", b"token-A3") is False and inner.read("lock") == b"token-A2"
        if inner.capabilities.atomic_rename:
            inner.write("tmp", [b"moved"])
            flaky.fail("rename", "after")
            calls = flaky.calls.get("rename", 0)
            r.rename("tmp", "dst")
            assert flaky.calls["rename"] == calls + 1 and inner.read("dst") == b"moved"

    def test_retry_gives_up_precisely(self, backend: Backend) -> None:
        r, flaky, _ = self._retrying(backend, "retry-give-up")
        flaky.fail("put", "permanent")
        with pytest.raises(StorageError) as ei:
            r.put("d/p", b"x")
        assert ei.value.errno == errno.EACCES and "d/p" in str(ei.value) and flaky.calls["put"] == 1
        flaky.fail("read", *["before"] * 10)
        with pytest.raises(StorageError) as ei:
            r.read("d/p")
        assert "retries exhausted" in str(ei.value) and "d/p" in str(ei.value)
        assert flaky.calls["read"] == _NO_WAIT.max_attempts
        assert isinstance(ei.value, CheckpointError)
