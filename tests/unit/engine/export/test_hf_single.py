"""The Hugging Face export in one process (no process group): an async save with ``hf_export``
returns with the folder complete; a failure while writing leaves no file behind; a link, a
folder that is not empty, a non-local path are refused with nothing written. Expected tensors
are the model's own, cast by torch; files are read with ``safetensors``."""

from __future__ import annotations

import json
import os

import pytest
import torch

import unickpt
from unickpt.storage import local_files

pytest.importorskip("safetensors.torch")

from tests.support.safetensors_folder import read_safetensors_folder as _read


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    m.register_buffer("steps", torch.arange(3))
    return m


def test_async_save_with_hf_export_returns_with_the_folder_complete(tmp_path) -> None:
    model = _model()
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "none"}')
    opts = unickpt.HFExport(dtype="fp16", max_shard_bytes=40, config=str(config))
    with unickpt.Checkpointer() as ckpt:
        ckpt.save(str(tmp_path / "ck"), {"model": model}, async_save=True, options=unickpt.SaveOptions(hf_export=opts))
        folder = tmp_path / "ck" / "huggingface"
        got = _read(str(folder))  # before any wait: the call returned after the export
    want = {k: (v.to(torch.float16) if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(want) and len(set(index["weight_map"].values())) > 1
    assert (folder / "config.json").read_text() == '{"model_type": "none"}'
    assert not [n for n in os.listdir(folder) if n.endswith(".unickpt-partial")]


def test_a_failed_write_leaves_no_file_and_raises(tmp_path, monkeypatch) -> None:
    calls = []
    real = os.pwrite

    def failing(fd: int, data: object, at: int) -> int:
        calls.append(at)
        if len(calls) > 3:  # the headers are written, then the data fails
            raise OSError(28, "No space left on device")
        return real(fd, data, at)  # type: ignore[arg-type]

    monkeypatch.setattr(local_files.os, "pwrite", failing)
    out = tmp_path / "hf"
    with pytest.raises(unickpt.CheckpointError):
        unickpt.export_hf(str(out), {"model": _model()}, unickpt.HFExport(max_shard_bytes=40))
    assert len(calls) > 3
    assert os.listdir(out) == []


def test_links_busy_folders_and_remote_paths_are_refused(tmp_path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, tmp_path / "link")
    with pytest.raises(unickpt.CheckpointError, match="symbolic link"):
        unickpt.export_hf(str(tmp_path / "link"), {"model": _model()})
    assert os.listdir(target) == []
    with pytest.raises(unickpt.CheckpointError, match="local"):
        unickpt.export_hf("s3://bucket/hf", {"model": _model()})
