"""Every error of the foundation: the right exception type, and a message naming the tensor/file.

All single-process (framework="torch") with tiny models. The checkpoint fixture saves a model, an
optimizer with state and extra state; each test breaks one thing and loads.

Its tests that start processes are in ``tests/integration/test_errors_processes.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from tests.support.compare import same_tensor
from unickpt.errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptMetadataError,
    DtypeMismatchError,
    FrameworkError,
    IncompleteCheckpointError,
    MissingDataFileError,
    MissingKeysError,
    NotACheckpointError,
    ShapeMismatchError,
    TruncatedDataFileError,
    UnexpectedKeysError,
    UnsupportedFormatVersionError,
)
from unickpt.format import METADATA_FILE, Metadata, decode_metadata
from unickpt.options import RestoreOptions


class Tiny(nn.Module):
    def __init__(self, hidden: int = 3, extra: str | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(4, hidden)
        self.b = nn.Linear(hidden, 2)
        if extra:
            self.register_parameter(extra, nn.Parameter(torch.randn(5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def trained(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def save(path: Path | str, model: nn.Module, optim: torch.optim.Optimizer | None = None, step: int = 1) -> None:
    state: dict[str, Any] = {"model": model, "extra_state": {"step": step}}
    if optim is not None:
        state["optimizer"] = optim
    unickpt.save(str(path), state, framework="torch").wait()


def load(path: Path | str, model: nn.Module, **kw: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"model": model}
    unickpt.load(str(path), state, framework="torch", **kw)
    return state


def metadata(path: Path) -> Metadata:
    return decode_metadata((path / METADATA_FILE).read_bytes())


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert same_tensor(got[k], v), k


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path / "ckpt"
    model, _ = trained(Tiny())
    save(path, model)
    return path, snapshot(model)


def shard_file(path: Path, fqn: str) -> tuple[Path, int, int]:
    """(data file, byte offset, byte length) of the first shard of ``fqn``."""
    md = metadata(path)
    s = md.tensors[fqn].shards[0]
    return path / md.files[s.file_index], s.byte_offset, s.byte_length


# ----------------------------------------------------------------------------- keys, shapes, dtypes


def test_loads_bit_exact(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, want = ckpt
    model = Tiny(seed=5)
    state = load(path, model)
    assert_same(model, want)
    assert state["model"] is model


def test_missing_keys(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    with pytest.raises(MissingKeysError) as info:
        load(path, Tiny(extra="gate"))
    assert "model.gate" in str(info.value) and str(path) in str(info.value)
    assert isinstance(info.value, KeyError)


def test_unexpected_keys(tmp_path: Path) -> None:
    save(tmp_path / "c", Tiny(extra="gate"))
    with pytest.raises(UnexpectedKeysError) as info:
        load(tmp_path / "c", Tiny())
    assert "model.gate" in str(info.value) and str(tmp_path / "c") in str(info.value)


def test_non_strict_loads_intersection_and_warns(tmp_path: Path) -> None:
    saved, _ = trained(Tiny(extra="old_gate"))
    save(tmp_path / "c", saved)
    model = Tiny(extra="new_gate", seed=7)
    untouched = model.new_gate.detach().clone()
    with pytest.warns(UserWarning) as record:
        load(tmp_path / "c", model, strict=False)
    msg = "\n".join(str(w.message) for w in record)
    assert "model.new_gate" in msg and "model.old_gate" in msg
    for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
        assert torch.equal(model.state_dict()[name], saved.state_dict()[name]), name
    assert torch.equal(model.new_gate, untouched)


def test_shape_mismatch(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    with pytest.raises(ShapeMismatchError) as info:
        load(path, Tiny(hidden=5))
    msg = str(info.value)
    assert "model.a.weight" in msg and "(3, 4)" in msg and "(5, 4)" in msg and str(path) in msg


def test_dtype_mismatch(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    with pytest.raises(DtypeMismatchError) as info:
        load(path, Tiny().to(torch.float64))
    msg = str(info.value)
    assert "model.a.weight" in msg and "float32" in msg and "float64" in msg


def test_failed_validation_leaves_model_untouched(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    model = Tiny(extra="gate", seed=3)
    before = snapshot(model)
    with pytest.raises(MissingKeysError):
        load(path, model)
    assert_same(model, before)  # validation happens before any byte is copied


# ----------------------------------------------------------------------------- data files


def test_missing_data_file(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    f, _, _ = shard_file(path, "model.a.weight")
    f.unlink()
    with pytest.raises(MissingDataFileError) as info:
        load(path, Tiny())
    msg = str(info.value)
    assert str(f) in msg
    holders = {
        fqn
        for fqn, t in metadata(path).tensors.items()
        if any(metadata(path).files[s.file_index] in str(f) for s in t.shards)
    }
    assert any(repr(h) in msg for h in holders), msg


def test_truncated_data_file(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    f, off, length = shard_file(path, "model.a.weight")
    with open(f, "r+b") as fh:
        fh.truncate(off + length // 2)
    with pytest.raises(TruncatedDataFileError) as info:
        load(path, Tiny())
    msg = str(info.value)
    assert str(f) in msg and "truncated" in msg
    md = metadata(path)
    name = os.path.relpath(f, path)
    cut = [
        fqn
        for fqn, t in md.tensors.items()
        for s in t.shards
        if md.files[s.file_index] == name and s.byte_offset + s.byte_length > off + length // 2
    ]
    assert "model.a.weight" in cut
    assert any(repr(fqn) in msg for fqn in cut), msg


def test_checksum_mismatch(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    f, off, length = shard_file(path, "model.b.weight")
    data = bytearray(f.read_bytes())
    data[off + length // 2] ^= 0x01  # one bit inside the shard's byte range
    f.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError) as info:
        load(path, Tiny())
    msg = str(info.value)
    assert "'model.b.weight'" in msg and str(f) in msg


def test_checksum_mismatch_in_extra_state(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    md = metadata(path)
    blob = md.blobs["extra_state/rank0"]
    f = path / md.files[blob.file_index]
    data = bytearray(f.read_bytes())
    data[blob.byte_offset + 2] ^= 0x20
    f.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="extra_state/rank0"):
        unickpt.load(str(path), {"model": Tiny(), "extra_state": None}, framework="torch")


# ----------------------------------------------------------------------------- metadata / folders


def test_incomplete_checkpoint(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    (path / METADATA_FILE).unlink()
    assert any((path / "data").rglob("*.bin"))
    with pytest.raises(IncompleteCheckpointError) as info:
        load(path, Tiny())
    assert str(path) in str(info.value) and "interrupted" in str(info.value)


@pytest.mark.parametrize("content", ["empty", "unrelated", "absent"])
def test_not_a_checkpoint(tmp_path: Path, content: str) -> None:
    path = tmp_path / "folder"
    if content != "absent":
        path.mkdir()
    if content == "unrelated":
        (path / "model.pt").write_bytes(b"PK\x03\x04")
        (path / "notes.txt").write_text("hello")
        (path / "sub").mkdir()
        (path / "sub" / "x.bin").write_bytes(b"\0" * 8)
    with pytest.raises(NotACheckpointError) as info:
        load(path, Tiny())
    if content == "absent":  # issue 26 item 11: said as it is
        assert str(info.value).endswith(f"no checkpoint at {path} (it does not exist)")
        return
    assert str(path) in str(info.value) and METADATA_FILE in str(info.value)


def test_not_a_checkpoint_when_path_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"PK\x03\x04")
    with pytest.raises(NotACheckpointError, match="model.pt"):
        load(path, Tiny())


def test_unsupported_format_version(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    doc = json.loads((path / METADATA_FILE).read_bytes())
    doc["format_version"] = 99
    (path / METADATA_FILE).write_text(json.dumps(doc))
    with pytest.raises(UnsupportedFormatVersionError) as info:
        load(path, Tiny())
    assert "99" in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("kind", ["garbage", "truncated"])
def test_corrupt_metadata(ckpt: tuple[Path, dict[str, torch.Tensor]], kind: str) -> None:
    path, _ = ckpt
    meta = path / METADATA_FILE
    data = meta.read_bytes()
    meta.write_bytes(b"\x8b\x00garbage\xff" if kind == "garbage" else data[: len(data) // 2])
    with pytest.raises(CorruptMetadataError) as info:
        load(path, Tiny())
    assert str(meta) in str(info.value)


# ----------------------------------------------------------------------------- frameworks


def test_framework_error_wrong_model_type(tmp_path: Path) -> None:
    with pytest.raises(FrameworkError) as info:
        unickpt.save(str(tmp_path / "c"), {"model": {"weight": torch.ones(2)}}, framework="torch")
    assert 'state["model"]' in str(info.value) and "dict" in str(info.value)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("*"))


def test_framework_error_unknown_framework(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = ckpt
    with pytest.raises(FrameworkError) as info:
        unickpt.load(str(path), {"model": Tiny()}, framework="jax")
    assert "'jax'" in str(info.value) and "fsdp2" in str(info.value)


def test_framework_error_invalid_state_key(tmp_path: Path) -> None:
    # any name is a key (issue 27); a key that is no name is refused, and a misspelt one is caught at load
    with pytest.raises(FrameworkError, match="'mod le'"):
        unickpt.save(str(tmp_path / "c"), {"mod le": Tiny()}, framework="torch")
    unickpt.save(str(tmp_path / "d"), {"modle": Tiny()}, framework="torch")
    with pytest.raises(MissingKeysError, match="modle"):
        unickpt.load(str(tmp_path / "d"), {"model": Tiny()}, framework="torch")


def test_all_errors_are_checkpoint_errors() -> None:
    for cls in (
        MissingKeysError,
        UnexpectedKeysError,
        ShapeMismatchError,
        DtypeMismatchError,
        MissingDataFileError,
        TruncatedDataFileError,
        ChecksumMismatchError,
        IncompleteCheckpointError,
        NotACheckpointError,
        UnsupportedFormatVersionError,
        CorruptMetadataError,
        FrameworkError,
    ):
        assert issubclass(cls, CheckpointError)


# (family, built-in) of every error class of 2026-11-27: the built-ins are those each class had
# before the families were added, the families those of issue 29 item 6
ERROR_FAMILIES: dict[str, tuple[str | None, type[BaseException] | None]] = {
    "NotACheckpointError": (None, FileNotFoundError),
    "IncompleteCheckpointError": (None, None),
    "UnsupportedFormatVersionError": (None, None),
    "CorruptMetadataError": ("IntegrityError", ValueError),
    "MissingDataFileError": ("IntegrityError", FileNotFoundError),
    "TruncatedDataFileError": ("IntegrityError", EOFError),
    "ChecksumMismatchError": ("IntegrityError", ValueError),
    "MissingKeysError": ("StateMismatchError", KeyError),
    "UnexpectedKeysError": ("StateMismatchError", KeyError),
    "ShapeMismatchError": ("StateMismatchError", ValueError),
    "DtypeMismatchError": ("StateMismatchError", TypeError),
    "LoaderStateError": ("StateMismatchError", ValueError),
    "ExtraStateResizeError": ("StateMismatchError", ValueError),
    "RankDisagreementError": ("CoordinationError", ValueError),
    "CollectiveError": ("CoordinationError", RuntimeError),
    "CollectiveTimeoutError": ("CoordinationError", TimeoutError),
    "RankFailures": ("CoordinationError", None),
    "RemoteRankError": ("CoordinationError", None),
    "ConcurrentSaveError": ("ConcurrencyError", None),
    "SaveLockLostError": ("ConcurrencyError", None),
    "SnapshotConflictError": ("ConcurrencyError", None),
    "FrameworkError": ("ConfigurationError", TypeError),
    "PlanningError": ("ConfigurationError", ValueError),
    "UnsafeNameError": ("ConfigurationError", ValueError),
    "OutputInsideSourceError": ("ConfigurationError", ValueError),
    "UnsupportedValueError": ("ConfigurationError", TypeError),
    "ForeignFolderError": ("ConfigurationError", FileExistsError),
    "MissingDependencyError": ("ConfigurationError", ImportError),
    "NoProcessGroupError": ("ConfigurationError", RuntimeError),
    "StorageError": ("StorageError", OSError),
    "TransientStorageError": ("StorageError", OSError),
    "UnsafePathError": ("StorageError", OSError),
    "SizeLimitError": (None, ValueError),
    "AsyncSaveFailures": (None, None),
}
FAMILIES = ("IntegrityError", "StateMismatchError", "CoordinationError", "ConcurrencyError", "ConfigurationError")


def test_issue29_error_families_group_every_class_and_keep_its_builtin() -> None:
    """Each class is in its family (and no other), keeps the built-in it had, and every class and
    family is importable from ``unickpt.errors`` and, since issue 41, from ``unickpt`` too."""
    from unickpt import errors

    for name, (family, builtin) in ERROR_FAMILIES.items():
        cls = getattr(errors, name)
        assert issubclass(cls, CheckpointError) and name in errors.__all__, name
        if builtin is not None:
            assert issubclass(cls, builtin), name
        for other in (*FAMILIES, "StorageError", "InternalError"):
            assert issubclass(cls, getattr(errors, other)) == (other == family), (name, other)
    for family in (*FAMILIES, "InternalError"):
        assert family in errors.__all__ and issubclass(getattr(errors, family), CheckpointError)
        assert getattr(unickpt, family) is getattr(errors, family), family  # issue 41: exported at the top
    assert issubclass(errors.InternalError, RuntimeError)
    assert not issubclass(errors.PlanningError, errors.InternalError)


def test_issue29_integrity_family_is_what_a_load_retry_catches(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """A missing, short or corrupt data file fails a load with an ``IntegrityError``: one
    ``except`` catches all three."""
    from unickpt.errors import IntegrityError

    path, _ = ckpt
    data, _, _ = shard_file(path, "model.a.weight")
    original = data.read_bytes()
    for damage in ("missing", "short", "zeros"):
        data.unlink()
        if damage != "missing":
            data.write_bytes(original[: len(original) // 2] if damage == "short" else bytes(len(original)))
        with pytest.raises(IntegrityError):
            load(path, Tiny())
        data.unlink(missing_ok=True)
        data.write_bytes(original)


# ----------------------------------------------------------------------------- interrupted saves


def test_failed_commit_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that dies after writing its data but before the commit leaves the old one loadable."""
    from unickpt.folder.publish import RenamePublisher

    path = tmp_path / "c"
    first, _ = trained(Tiny(seed=1))
    save(path, first, step=1)
    want = snapshot(first)
    second, _ = trained(Tiny(seed=2))

    def broken_commit(self: RenamePublisher, name: str, data: bytes) -> None:
        raise OSError("simulated crash before the metadata is published")

    monkeypatch.setattr(RenamePublisher, "publish", broken_commit)
    with pytest.raises(Exception, match="simulated crash"):
        save(path, second, step=2)
    monkeypatch.undo()
    model = Tiny(seed=9)
    state = {"model": model, "extra_state": None}
    unickpt.load(str(path), state, framework="torch")
    assert_same(model, want)
    assert state["extra_state"] == {"step": 1}
    # the next successful save removes the interrupted save's data; it keeps only its own and the
    # generation it replaced (for loads still reading that one)
    from unickpt.folder.probe import committed_save_id
    from unickpt.storage import open_storage

    first_id = committed_save_id(open_storage(str(path)))
    save(path, second, step=3)
    left = {p.parent.name for p in (path / "data").rglob("*.bin")}
    assert left == {first_id, committed_save_id(open_storage(str(path)))}


def test_issue9_item7_cleanup_failure_after_commit_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old data that cannot be deleted after the commit: the save succeeds (its checkpoint is
    committed and loads) and a warning names the files and the reason."""
    from unickpt.folder.probe import committed_save_id
    from unickpt.storage import open_storage
    from unickpt.storage.local import LocalStorage

    path = tmp_path / "c"
    for seed in (1, 2):
        save(path, trained(Tiny(seed=seed))[0], step=seed)
    oldest = {p.parent.name for p in (path / "data").rglob("*.bin")} - {committed_save_id(open_storage(str(path)))}
    assert len(oldest) == 1  # the first save's data: the third save's cleanup removes it
    (old_id,) = oldest
    real_delete = LocalStorage.delete

    def undeletable(self: LocalStorage, names: Any) -> None:
        if any(old_id in n for n in names):
            raise unickpt.StorageError(13, f"injected: cannot delete {names[0]}")
        real_delete(self, names)

    monkeypatch.setattr(LocalStorage, "delete", undeletable)
    third, _ = trained(Tiny(seed=3))
    with pytest.warns(UserWarning) as record:
        md = unickpt.save(str(path), {"model": third, "extra_state": {"step": 3}}, framework="torch").wait()
    msg = "\n".join(str(w.message) for w in record)
    assert md is not None and md.save_id in msg and "injected: cannot delete" in msg, msg
    assert f"Left behind: data/{old_id}/" in msg, msg  # the files, and the reason above
    monkeypatch.undo()
    state = load(path, Tiny(seed=9))
    assert_same(state["model"], snapshot(third))


# ----------------------------------------------------------------------------- issue 10 item 10: hints


class Wide(nn.Module):
    """15 parameters, to see a capped list of dtype problems."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(7))
        self.scale = nn.Parameter(torch.ones(3))


def test_item10_dtype_mismatch_capped_with_cast_hint(tmp_path: Path) -> None:
    unickpt.save(str(tmp_path / "c"), {"model": Wide()}, framework="torch").wait()
    with pytest.raises(DtypeMismatchError) as info:
        unickpt.load(str(tmp_path / "c"), {"model": Wide().double()}, framework="torch")
    msg = str(info.value)
    listed = [line for line in msg.splitlines() if "checkpoint dtype float32, live dtype float64" in line]
    assert len(listed) == 10 and "and 5 more" in msg
    assert "cast_dtypes=True" in msg and ".to(" in msg


def test_item10_cast_dtypes_bit_exact(tmp_path: Path) -> None:
    """fp32 checkpoint -> bf16 / fp16 model with LoadOptions(restore=RestoreOptions(cast_dtypes=True)): each
    tensor equals torch's own ``.to(dtype)`` of the saved tensor."""
    model, _ = trained(Tiny())
    save(tmp_path / "c", model)
    want = snapshot(model)
    for dtype in (torch.bfloat16, torch.float16):
        target = Tiny(seed=4).to(dtype)
        load(tmp_path / "c", target, options=unickpt.LoadOptions(restore=RestoreOptions(cast_dtypes=True)))
        for k, v in target.state_dict().items():
            assert v.dtype == dtype and torch.equal(v, want[k].to(dtype)), k


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_item10_not_a_checkpoint_says_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    dcp.save({"model": Tiny().state_dict()}, checkpoint_id=str(path))
    assert (path / ".metadata").exists() and any(p.suffix == ".distcp" for p in path.iterdir())
    with pytest.raises(NotACheckpointError) as info:
        load(path, Tiny())
    msg = str(info.value)
    assert "PyTorch DCP" in msg and "torch.distributed.checkpoint" in msg and "unickpt convert" in msg


def test_item10_not_a_checkpoint_lists_manager_steps(tmp_path: Path) -> None:
    root = tmp_path / "run"
    manager = unickpt.CheckpointManager(str(root), keep_last=5)
    model = Tiny()
    for s in (2, 4):
        manager.save(s, {"model": model}, framework="torch").wait()
    with pytest.raises(NotACheckpointError) as info:
        load(root, Tiny())
    msg = str(info.value)
    assert "CheckpointManager" in msg and "load_latest" in msg
    assert "step_00000002" in msg and "step_00000004" in msg
    assert str(root / "step_00000004") in msg  # the newest one, to pass as a path


def test_item10_missing_keys_also_lists_unexpected(tmp_path: Path) -> None:
    save(tmp_path / "c", Tiny(extra="old_gate"))
    with pytest.raises(MissingKeysError) as info:
        load(tmp_path / "c", Tiny(extra="new_gate"))
    msg = str(info.value)
    assert "model.new_gate" in msg and "model.old_gate" in msg
