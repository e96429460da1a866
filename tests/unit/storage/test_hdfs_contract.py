"""The storage contract (``contract.py``) against ``HdfsStorage``.

Two ways, and the README says which ran where:
- always: over ``hdfs_standin.LocalHdfsClient`` (HDFS's create/rename/list semantics on a local
  folder), bare and through the retrying wrapper: every code path of the backend that does not
  depend on the wire protocol;
- with ``UNICKPT_TEST_HDFS_URL=hdfs://namenode:port/some/test/folder`` set: the same suite, plus a
  2-rank save and a resharding load, against that real cluster through ``hdfs-native``
  (skipped otherwise: there is no HDFS cluster on these machines).
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Callable

import pytest

from tests.fixtures.contract import StorageContract
from tests.fixtures.hdfs_standin import LocalHdfsClient
from unickpt.errors import StorageError, TransientStorageError
from unickpt.storage import StorageOptions, open_storage
from unickpt.storage.base import Storage
from unickpt.storage.hdfs import HdfsStorage, split_hdfs_path
from unickpt.storage.retry import RetryingStorage, RetryPolicy, unwrap

HDFS_URL_ENV = "UNICKPT_TEST_HDFS_URL"
_OPTIONS = StorageOptions(part_size=5 << 20, max_concurrency=4)


class TestHdfsContractOnStandin(StorageContract):
    @pytest.fixture(params=["bare", "retrying"])
    def backend(self, request: pytest.FixtureRequest, tmp_path) -> Callable[[str], Storage]:
        client = LocalHdfsClient(str(tmp_path / "hdfs"))

        def make(root: str) -> Storage:
            s = HdfsStorage(f"namenode:8020/user/ci/{root}", _OPTIONS, client=client)
            return s if request.param == "bare" else RetryingStorage(s, RetryPolicy(initial_delay_s=0.0, jitter=0.0))

        return make


@pytest.mark.skipif(not os.environ.get(HDFS_URL_ENV), reason=f"no HDFS cluster: set {HDFS_URL_ENV} to run")
class TestHdfsContractOnCluster(StorageContract):
    @pytest.fixture
    def backend(self) -> Callable[[str], Storage]:
        base = os.environ[HDFS_URL_ENV].rstrip("/") + f"/unickpt-contract-{uuid.uuid4().hex[:8]}"
        return lambda root: open_storage(f"{base}/{root}", _OPTIONS)


def test_hdfs_urls_split_into_authority_and_root():
    assert split_hdfs_path("nn:8020/a/b/") == ("nn:8020", "/a/b")
    assert split_hdfs_path("/a/b") == ("", "/a/b")
    assert split_hdfs_path("nn") == ("nn", "/")
    with pytest.raises(StorageError) as e:
        split_hdfs_path("nn/a/../b")
    assert e.value.errno == errno.EINVAL


def test_hdfs_scheme_is_registered_with_its_extra():
    from unickpt.storage.registry import DEFAULT_REGISTRY

    entry = DEFAULT_REGISTRY.entry("hdfs")
    assert entry.extra == "hdfs"


def test_client_errors_are_classified(tmp_path):
    s = HdfsStorage("nn/x", _OPTIONS, client=LocalHdfsClient(str(tmp_path)))
    cases = [
        (ConnectionResetError("reset by peer"), TransientStorageError),
        (RuntimeError("org.apache.hadoop.ipc.StandbyException: Operation category READ"), TransientStorageError),
        (RuntimeError("All nodes failed for write"), TransientStorageError),
        (PermissionError("denied"), StorageError),
        (RuntimeError("org.apache.hadoop.security.AccessControlException: Permission denied"), StorageError),
        (RuntimeError("InvalidPath"), StorageError),
    ]
    for raised, kind in cases:
        got = s._translate("create", "data/f.bin", raised)
        assert type(got) is kind, (raised, got)
        assert "hdfs://nn/x/data/f.bin" in str(got)
    assert s._translate("create", "f", PermissionError("x")).errno == errno.EACCES


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    client = LocalHdfsClient(str(tmp_path))
    s = HdfsStorage("nn/x", _OPTIONS, client=client)

    real_create = client.create

    def create(path, opts):
        w = real_create(path, opts)
        real_write = w.write

        def write(buf):
            real_write(buf)
            raise ConnectionResetError("DataNode pipeline broke")

        w.write = write
        return w

    client.create = create
    with pytest.raises(TransientStorageError):
        s.write("data/a.bin", [b"x" * 100])
    assert s.list() == []


def test_large_ranged_reads_are_split_into_parallel_spans(tmp_path):
    client = LocalHdfsClient(str(tmp_path))
    s = HdfsStorage("nn/x", _OPTIONS, client=client)
    data = os.urandom((5 << 20) * 3 + 12345)
    s.write("big.bin", [data])
    out = bytearray(len(data) - 777)
    s.read_into("big.bin", 777, memoryview(out))
    assert bytes(out) == data[777:]


@pytest.mark.skipif(not os.environ.get(HDFS_URL_ENV), reason=f"no HDFS cluster: set {HDFS_URL_ENV} to run")
def test_checkpoint_round_trip_on_cluster():
    import torch

    import unickpt

    url = os.environ[HDFS_URL_ENV].rstrip("/") + f"/unickpt-ckpt-{uuid.uuid4().hex[:8]}"
    model = torch.nn.Linear(100, 10)
    unickpt.save(url, {"model": model})
    fresh = torch.nn.Linear(100, 10)
    unickpt.load(url, {"model": fresh})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert isinstance(unwrap(open_storage(url)), HdfsStorage)


def test_checkpoint_manager_and_verify_over_the_standin(tmp_path):
    """A whole checkpoint workflow (save, manager retention, verify, load) through the registry,
    on ``HdfsStorage`` over the stand-in client: publication by rename-over, exclusive creates."""
    import torch

    import unickpt
    from unickpt.cli import main as cli
    from unickpt.storage.registry import DEFAULT_REGISTRY

    client = LocalHdfsClient(str(tmp_path / "hdfs"))
    DEFAULT_REGISTRY.register(
        "hdfs-standin", lambda path, options: HdfsStorage(path, options, client=client), replace=True
    )
    try:
        root = "hdfs-standin://nn:8020/jobs/run1"
        manager = unickpt.CheckpointManager(root, keep_last=2)
        model = torch.nn.Linear(8, 64)
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.fill_(float(step))
                model.bias.copy_(torch.arange(64.0) + step)
            manager.save(step, {"model": model})
        manager.wait()
        assert [info.step for info in manager.list_checkpoints()] == [2, 3]
        assert cli(["verify", manager.path_for(3)]) == 0
        fresh = torch.nn.Linear(8, 64)
        assert manager.load_latest({"model": fresh}) == 3
        assert torch.equal(fresh.weight, torch.full((64, 8), 3.0))
        assert torch.equal(fresh.bias, torch.arange(64.0) + 3)
    finally:
        DEFAULT_REGISTRY.unregister("hdfs-standin")
