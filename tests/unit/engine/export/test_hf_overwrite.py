"""The in-save Hugging Face export over an existing checkpoint, and retention of exported steps
(one process, no process group): a save replacing a checkpoint replaces its export (with
``hf_export``) or removes it (without); files unickpt did not write in ``huggingface/`` refuse a
save with ``hf_export`` before anything is written (the old checkpoint stays whole) and are never
deleted; retention and ``unickpt prune`` delete a step's export with it; links are never followed.
Expected tensors are the models' own; files are read with ``safetensors``."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import unickpt
from tests.support.compare import same_state
from unickpt.cli import main as cli_main

pytest.importorskip("safetensors.torch")

from tests.support.safetensors_folder import read_safetensors_folder as _read

MANIFEST = "unickpt.hf_export.json"


def _model(seed: int, width: int = 6) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))


def _opts(shard: int = 40) -> unickpt.SaveOptions:
    return unickpt.SaveOptions(hf_export=unickpt.HFExport(max_shard_bytes=shard))


def test_overwrite_with_hf_export_replaces_the_old_export(tmp_path) -> None:
    path = str(tmp_path / "ck")
    old, new = _model(1), torch.nn.Linear(4, 4)
    with unickpt.Checkpointer() as ckpt:
        ckpt.save(path, {"model": old}, options=_opts())
        hf = os.path.join(path, "huggingface")
        assert len([n for n in os.listdir(hf) if n.endswith(".safetensors")]) > 1 and same_state(
            _read(hf), old.state_dict()
        )
        ckpt.save(path, {"model": new}, options=_opts(1 << 20))  # one file: every old shard's name goes
        assert sorted(os.listdir(hf)) == sorted(["model.safetensors", "model.safetensors.index.json", MANIFEST])
        assert same_state(_read(hf), new.state_dict())
        # an async save over it: the call returns with the new export in place
        newer = torch.nn.Linear(4, 4)
        ckpt.save(path, {"model": newer}, async_save=True, options=_opts(1 << 20))
        assert same_state(_read(hf), newer.state_dict())
        back = torch.nn.Linear(4, 4)
        ckpt.load(path, {"model": back})
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), newer.state_dict().values()))


def test_overwrite_without_hf_export_removes_the_stale_export(tmp_path) -> None:
    path = str(tmp_path / "ck")
    with unickpt.Checkpointer() as ckpt:
        ckpt.save(path, {"model": _model(1)}, options=_opts())
        assert os.path.isdir(os.path.join(path, "huggingface"))
        ckpt.save(path, {"model": torch.nn.Linear(4, 4)})
    assert not os.path.exists(os.path.join(path, "huggingface"))


def test_a_foreign_file_in_the_export_folder_refuses_the_save_and_stays(tmp_path) -> None:
    path = str(tmp_path / "ck")
    old = _model(1)
    with unickpt.Checkpointer() as ckpt:
        ckpt.save(path, {"model": old}, options=_opts())
        hf = os.path.join(path, "huggingface")
        before = sorted(os.listdir(hf))
        with open(os.path.join(hf, "README.md"), "w") as f:
            f.write("the user's")
        with pytest.raises(unickpt.errors.ForeignFolderError, match=r"README\.md.*Nothing was saved"):
            ckpt.save(path, {"model": _model(2)}, options=_opts())
        back = _model(3)
        ckpt.load(path, {"model": back})  # the old checkpoint, whole
        assert same_state(dict(back.state_dict()), old.state_dict())
        assert sorted(os.listdir(hf)) == sorted([*before, "README.md"]) and same_state(_read(hf), old.state_dict())
        # without hf_export: the new checkpoint commits, unickpt's export files go, the user's stays
        with pytest.warns(UserWarning, match="did not write stay"):
            ckpt.save(path, {"model": _model(2)})
    assert os.listdir(hf) == ["README.md"]
    assert open(os.path.join(hf, "README.md")).read() == "the user's"


def test_links_in_or_at_the_export_folder_are_never_followed(tmp_path) -> None:
    path = str(tmp_path / "ck")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"the user's weights")
    with unickpt.Checkpointer() as ckpt:
        ckpt.save(path, {"model": torch.nn.Linear(4, 4)}, options=_opts(1 << 20))
        hf = os.path.join(path, "huggingface")
        size = os.path.getsize(os.path.join(hf, "model.safetensors"))
        os.unlink(os.path.join(hf, "model.safetensors"))  # a link under a name the manifest lists
        os.symlink(outside / "model.safetensors", os.path.join(hf, "model.safetensors"))
        with pytest.raises(unickpt.errors.ForeignFolderError, match="model.safetensors"):
            ckpt.save(path, {"model": torch.nn.Linear(4, 4)}, options=_opts(1 << 20))
        with pytest.warns(UserWarning, match="did not write stay"):
            ckpt.save(path, {"model": torch.nn.Linear(4, 4)})
        assert os.listdir(hf) == ["model.safetensors"] and os.path.islink(os.path.join(hf, "model.safetensors"))
        assert (outside / "model.safetensors").read_bytes() == b"the user's weights"
        assert size > len(b"the user's weights")
        # the whole folder a link to a copy of an export: neither read nor emptied
        os.unlink(os.path.join(hf, "model.safetensors"))
        os.rmdir(hf)
        copy = tmp_path / "copy"
        ckpt.save(str(tmp_path / "src"), {"model": torch.nn.Linear(4, 4)}, options=_opts(1 << 20))
        os.rename(tmp_path / "src" / "huggingface", copy)
        os.symlink(copy, hf)
        with pytest.raises(unickpt.errors.ForeignFolderError):
            ckpt.save(path, {"model": torch.nn.Linear(4, 4)}, options=_opts(1 << 20))
        ckpt.save(path, {"model": torch.nn.Linear(4, 4)})
    assert os.path.islink(hf) and sorted(os.listdir(copy)) == sorted(
        ["model.safetensors", "model.safetensors.index.json", MANIFEST]
    )


def test_retention_and_prune_delete_a_step_with_its_export(tmp_path, capsys) -> None:
    root = str(tmp_path / "ckpts")
    models = {step: _model(step) for step in (1, 2, 3)}
    with unickpt.Checkpointer() as ckpt:
        manager = unickpt.CheckpointManager(root, keep_last=1, checkpointer=ckpt)
        manager.save(1, {"model": models[1]}, options=_opts())
        manager.save(2, {"model": models[2]}, options=_opts())
        assert not os.path.exists(os.path.join(root, "step_00000001"))  # retention: the export went too
        assert same_state(_read(os.path.join(root, "step_00000002", "huggingface")), models[2].state_dict())
        keep_all = unickpt.CheckpointManager(root, keep_last=None, checkpointer=ckpt)
        keep_all.save(3, {"model": models[3]}, options=_opts())
    assert cli_main(["ls", root]) == 0
    listed = capsys.readouterr().out
    assert listed.count("[hf export]") == 2, listed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli_main(["prune", root, "--keep-last", "1"]) == 0
    assert "steps [2]" in capsys.readouterr().out
    assert sorted(os.listdir(root)) == ["latest", "step_00000003"]
    assert same_state(_read(os.path.join(root, "step_00000003", "huggingface")), models[3].state_dict())


def test_a_failed_export_leaves_its_record_and_the_next_save_replaces_it(tmp_path, monkeypatch) -> None:
    from unickpt.storage import local_files

    path = str(tmp_path / "ck")
    real = os.pwrite
    calls: list[int] = []

    def failing(fd: int, data: object, at: int) -> int:
        calls.append(at)
        if len(calls) > 3:  # headers written, then the data fails
            raise OSError(28, "No space left on device")
        return real(fd, data, at)  # type: ignore[arg-type]

    with unickpt.Checkpointer() as ckpt:
        monkeypatch.setattr(local_files.os, "pwrite", failing)
        with pytest.raises(unickpt.CheckpointError):
            ckpt.save(path, {"model": _model(1)}, options=_opts())
        monkeypatch.setattr(local_files.os, "pwrite", real)
        hf = os.path.join(path, "huggingface")
        assert os.listdir(hf) == [MANIFEST]  # the partial files went; the record says what was meant
        model = _model(2)
        ckpt.save(path, {"model": model}, options=_opts())
    assert same_state(_read(hf), model.state_dict())


def test_issue39_item17_an_incomplete_export_record_deletes_only_unickpts_temporaries(tmp_path, capsys) -> None:
    """An export interrupted after its first record (``complete: false``), then the user's own
    files in ``huggingface/``, among them names the record lists: retention and ``unickpt prune``
    delete the step's checkpoint, the export's temporaries and the record, and none of the
    user's files."""
    import json

    root = tmp_path / "ckpts"
    with unickpt.Checkpointer() as ckpt:
        manager = unickpt.CheckpointManager(str(root), keep_last=None, checkpointer=ckpt)
        for step in (1, 2, 3):
            manager.save(step, {"model": _model(step)}, options=_opts())
    hf = root / "step_00000001" / "huggingface"
    record = json.loads((hf / MANIFEST).read_text())
    listed = [name for name, _ in record["files"]]
    assert "model.safetensors.index.json" in listed and len(listed) > 2, listed
    sizes = {name: (hf / name).stat().st_size for name in listed}
    for name in listed:  # what an export interrupted in its write stage leaves: temporaries only
        (hf / name).rename(hf / (name + ".unickpt-partial"))
    record["complete"] = False
    record["files"] = [[name, None] for name in listed]
    (hf / MANIFEST).write_text(json.dumps(record))
    # the temporary of one shard is gone (the user deleted it); the user's own files arrive, two
    # under names the record lists and of the very sizes the export gave them
    shard = listed[0]
    (hf / (shard + ".unickpt-partial")).unlink()
    users = {
        shard: b"u" * sizes[shard],
        "model.safetensors.index.json": b"{" + b" " * (sizes["model.safetensors.index.json"] - 2) + b"}",
        "tokenizer.json": b'{"version": "1.0"}',
        "README.md": b"# my model\n",
    }
    for name, data in users.items():
        (hf / name).write_bytes(data)
    ours = sorted(n + ".unickpt-partial" for n in listed if n != shard) + [MANIFEST]

    assert cli_main(["ls", str(root)]) == 0
    assert "hf export (incomplete)" in capsys.readouterr().out
    plan = unickpt.CheckpointManager(str(root), keep_last=2).plan_retention()
    planned = {n for _, groups in plan.deletions for g in groups for n in g}
    assert {n for n in planned if "/huggingface/" in n} == {f"step_00000001/huggingface/{n}" for n in ours}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli_main(["prune", str(root), "--keep-last", "2"]) == 0
    assert "steps [1]" in capsys.readouterr().out
    assert sorted(os.listdir(hf)) == sorted(users)
    assert all((hf / name).read_bytes() == data for name, data in users.items())


def test_issue39_item17_no_export_file_takes_its_final_name_before_the_complete_record(tmp_path, monkeypatch) -> None:
    """The ordering that makes the rule above safe without leaking: every rename of an export file
    into its final name happens with the record already complete (so an interruption at any
    moment leaves either temporaries beside an incomplete record, or a complete record)."""
    import json

    from unickpt.storage import local_files

    real = local_files.rename_at  # the export renames relative to its folder's descriptor
    seen: list[tuple[str, bool]] = []

    def watched(src_dir: int, src: str, dst_dir: int, dst: str) -> None:
        if src.endswith(".unickpt-partial") and not dst.endswith(MANIFEST):
            with open(os.open(MANIFEST, os.O_RDONLY, dir_fd=dst_dir), "rb") as f:
                seen.append((os.path.basename(dst), json.loads(f.read())["complete"]))
        real(src_dir, src, dst_dir, dst)

    monkeypatch.setattr(local_files, "rename_at", watched)
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "test"}')
    opts = unickpt.SaveOptions(hf_export=unickpt.HFExport(max_shard_bytes=40, config=str(config)))
    model = _model(3)
    unickpt.save(str(tmp_path / "ck"), {"model": model}, options=opts)
    names = [n for n, _ in seen]
    assert len(names) > 3 and "config.json" in names, names
    assert all(done for _, done in seen), seen
    last_shard = max(i for i, n in enumerate(names) if n.endswith(".safetensors"))
    assert names.index("model.safetensors.index.json") > last_shard, names  # the index appears last
    assert same_state(_read(str(tmp_path / "ck" / "huggingface")), model.state_dict())
