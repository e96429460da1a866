"""The retry wrapper wraps the declared protocol method by method, with an explicit idempotency
decision each: a step that cannot be repeated blindly (exclusive create, compare-and-swap,
rename, exclusive write) is checked after a failure whose effect is unknown — "my own earlier
attempt succeeded" is told apart from "someone else holds it" by the object's content."""

from __future__ import annotations

import errno
from typing import Any

import pytest

from unickpt.errors import StorageError, TransientStorageError
from unickpt.storage.base import Storage
from unickpt.storage.memory import MemoryStorage
from unickpt.storage.retry import RetryingStorage, RetryPolicy

_FAST = RetryPolicy(max_attempts=4, initial_delay_s=0.0, jitter=0.0)


class LostReplies:
    """A backend whose next call of each op in ``plan`` fails: ``"after"`` lands, then the reply
    is lost (a timeout); ``"before"`` times out without effect; ``"permanent"``: EACCES."""

    def __init__(self, inner: Any, **plan: list[str]) -> None:
        self.inner, self.plan = inner, {k: list(v) for k, v in plan.items()}
        self.url = inner.url
        self.calls: dict[str, int] = {}

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[attr] = self.calls.get(attr, 0) + 1
            mode = self.plan.get(attr, []).pop(0) if self.plan.get(attr) else None
            if mode == "before":
                raise TimeoutError(f"injected timeout before {attr}")
            if mode == "permanent":
                raise PermissionError(errno.EACCES, f"injected EACCES in {attr}")
            out = value(*args, **kwargs)
            if mode == "after":
                raise TransientStorageError(errno.ETIMEDOUT, f"injected: reply of {attr} lost")
            return out

        return call


def _mem(tmp_path: Any, name: str) -> Any:
    return MemoryStorage(f"retry-{tmp_path.name}-{name}")


def test_a3_exclusive_create_after_a_lost_reply_tells_own_success_from_another_holder(tmp_path):
    inner = _mem(tmp_path, "create")
    flaky = LostReplies(inner, create_exclusive=["after", "before", "before"])
    s = RetryingStorage(flaky, _FAST, sleep=lambda _: None)
    assert s.create_exclusive("lock", b"token-mine") is True  # it landed: the retry sees our bytes
    assert inner.read("lock") == b"token-mine"
    inner.create_exclusive("other", b"token-theirs")
    assert s.create_exclusive("other", b"token-mine") is False  # retried, someone else holds it
    assert inner.read("other") == b"token-theirs"


def test_a3_write_after_a_lost_reply_is_not_reported_as_an_existing_file(tmp_path):
    inner = _mem(tmp_path, "write")
    s = RetryingStorage(LostReplies(inner, write=["after", "before"]), _FAST, sleep=lambda _: None)
    s.write("data/a.bin", [b"abc", memoryview(b"defg")])
    assert inner.read("data/a.bin") == b"abcdefg"
    inner.write("data/b.bin", [b"someone else's"])
    with pytest.raises(StorageError) as ei:  # a real conflict stays one, named
        s.write("data/b.bin", [b"mine, same size.."])
    assert ei.value.errno == errno.EEXIST and "data/b.bin" in str(ei.value)
    assert inner.read("data/b.bin") == b"someone else's"


def test_a3_update_exclusive_after_a_lost_reply(tmp_path):
    inner = _mem(tmp_path, "update")
    inner.create_exclusive("lock", b"v1")
    flaky = LostReplies(inner, update_exclusive=["after", "before"])
    s = RetryingStorage(flaky, _FAST, sleep=lambda _: None)
    assert s.update_exclusive("lock", b"v1", b"v2") is True  # not a spurious "lock lost"
    assert inner.read("lock") == b"v2"
    assert s.update_exclusive("lock", b"v2", b"v3") is True  # "before": repeated, lands
    inner.delete(["lock"])
    inner.create_exclusive("lock", b"breaker")
    flaky.plan["update_exclusive"] = ["before"]
    assert s.update_exclusive("lock", b"v3", b"v4") is False
    assert inner.read("lock") == b"breaker"


def test_a3_rename_is_not_repeated_after_it_took_effect(tmp_path):
    inner = _mem(tmp_path, "rename")
    inner.write("tmp", [b"new"])
    flaky = LostReplies(inner, rename=["after"])
    s = RetryingStorage(flaky, _FAST, sleep=lambda _: None)
    s.rename("tmp", "target")
    assert flaky.calls["rename"] == 1 and inner.read("target") == b"new" and inner.size("tmp") is None
    inner.write("tmp2", [b"newer"])
    flaky.plan["rename"] = ["before"]
    s.rename("tmp2", "target")
    assert flaky.calls["rename"] == 3 and inner.read("target") == b"newer"


def test_a3_permanent_errors_are_not_retried_and_name_the_object(tmp_path):
    inner = _mem(tmp_path, "perm")
    flaky = LostReplies(inner, put=["permanent"], create_exclusive=["permanent"])
    s = RetryingStorage(flaky, _FAST, sleep=lambda _: None)
    for op, call in (("put", lambda: s.put("p", b"x")), ("create_exclusive", lambda: s.create_exclusive("c", b"x"))):
        with pytest.raises(StorageError) as ei:
            call()
        assert ei.value.errno == errno.EACCES and inner.url in str(ei.value), ei.value
        assert flaky.calls[op] == 1


def test_a3_retrying_storage_wraps_the_declared_protocol_only(tmp_path):
    """No forwarding of undeclared attributes: the wrapper has exactly the protocol's members,
    and shows its backend's url and capabilities."""
    inner = _mem(tmp_path, "members")
    s = RetryingStorage(inner, _FAST)
    assert isinstance(s, Storage)
    assert s.capabilities == inner.capabilities and s.url == inner.url
    for undeclared in ("sync_dir", "commit", "root", "shared_page_cache", "break_lock"):
        assert not hasattr(s, undeclared), undeclared
