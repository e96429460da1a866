"""``unickpt ls`` / ``latest`` / ``prune`` (issue 26, items 1 and 15): their own help texts,
``prune --dry-run``, a missing root, folders retention keeps shown by ``ls``. In-process
(``cli.main``), single process."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

import unickpt
from unickpt.cli import build_parser, main
from unickpt.format.records import METADATA_FILE


def _files(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def _root(tmp_path) -> tuple[str, unickpt.CheckpointManager]:
    root = str(tmp_path / "run")
    manager = unickpt.CheckpointManager(root, keep_last=None)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    for step in (10, 20, 30):
        manager.save(step, {"model": model})
    return root, manager


def _help(name: str) -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return " ".join(sub.choices[name].format_help().split())


def test_issue26_item15_ls_latest_prune_have_their_own_help():
    ls, latest, prune = _help("ls"), _help("latest"), _help("prune")
    assert "deleted" not in ls and "deleted" not in latest  # was prune's "(only files unickpt wrote are deleted)"
    assert "unreadable" in ls and "foreign" in ls
    assert "latest pointer" in latest
    assert "--dry-run" in prune and "--dry-run" not in ls + latest


def test_issue26_item15_prune_dry_run_lists_and_deletes_nothing(tmp_path, capsys):
    root, manager = _root(tmp_path)
    os.makedirs(os.path.join(root, "step_00000001"))
    open(os.path.join(root, "step_00000001", "notes.txt"), "w").write("mine")
    before = _files(root)
    assert main(["prune", root, "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert _files(root) == before  # nothing deleted
    listed = {line.strip()[len(root) + 1 :] for line in out.splitlines() if line.startswith(f"  {root}/")}
    assert "would delete 2 checkpoint(s): steps [10, 20]" in out and "would keep step 1 (foreign" in out, out
    assert listed and all(n.startswith(("step_00000010/", "step_00000020/")) for n in listed), listed
    assert main(["prune", root, "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "deleted 2 checkpoint(s): steps [10, 20]" in out and "kept step 1 (foreign" in out, out
    assert before - _files(root) == listed  # the dry run named exactly what went
    assert [c.step for c in manager.list_checkpoints()] == [30]


def test_issue26_item15_ls_on_a_missing_root_is_an_error(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    for cmd in (["ls", missing], ["latest", missing], ["prune", missing, "--keep-last", "1"]):
        assert main(cmd) != 0, cmd
        err = capsys.readouterr().err
        assert f"no checkpoint at {missing} (it does not exist)" in err and "Traceback" not in err, err
    assert not os.path.exists(missing)
    os.makedirs(missing)  # an existing, empty root: nothing saved yet, not an error
    assert main(["ls", missing]) == 0 and "no checkpoint under" in capsys.readouterr().out


def test_issue26_item1_ls_names_the_folders_retention_keeps(tmp_path, capsys):
    root, _ = _root(tmp_path)
    path = os.path.join(root, "step_00000010", METADATA_FILE)
    doc = json.loads(open(path).read())
    doc["format_version"] = 99
    open(path, "w").write(json.dumps(doc))
    os.makedirs(os.path.join(root, "step_00000005", "data"))
    open(os.path.join(root, "step_00000005", "data", "x.bin"), "wb").write(b"mine")
    os.makedirs(os.path.join(root, "step_00000040"))
    open(os.path.join(root, "step_00000040", METADATA_FILE), "w").write(
        open(os.path.join(root, "step_00000030", METADATA_FILE)).read()
    )
    assert main(["ls", root]) == 0
    lines = {int(ln.split()[1]): ln for ln in capsys.readouterr().out.splitlines()}
    assert "foreign" in lines[5] and "unreadable" in lines[10] and "format version 99" in lines[10]
    assert "damaged" in lines[40] and "missing" in lines[40]
    assert "<- latest" in lines[30] and "B " in lines[20]


def _save(path: str) -> None:
    torch.manual_seed(0)
    unickpt.save(path, {"model": nn.Linear(4, 3)})


def test_issue39_item18_ls_outside_a_manager_root_lists_every_checkpoint_below(tmp_path, capsys):
    """A Lightning ``dirpath``, an HF ``output_dir`` (``checkpoint-N/unickpt``) and the folders of
    ``unickpt.save("ckpts/step_100")``: ``ls`` lists every checkpoint below with the states it
    uses for step folders; a linked folder is not entered; ``inspect checkpoint-8`` points to
    ``checkpoint-8/unickpt``; ``ls`` and ``inspect`` / ``verify`` use one word for an interrupted
    save."""
    work = tmp_path / "work"
    _save(str(work / "ckpts" / "step_100"))
    _save(str(work / "lightning" / "epoch=0-step=10.ckpt"))
    _save(str(work / "out" / "checkpoint-8" / "unickpt"))
    interrupted = work / "out" / "checkpoint-9" / "unickpt"  # a save killed before its data: its marker
    interrupted.mkdir(parents=True)
    (interrupted / "unickpt.data.20991231T000000-aaaaaaaaaaaa").write_bytes(b"")
    (work / "out" / "checkpoint-8" / "trainer_state.json").write_text("{}")
    outside = tmp_path / "outside"
    _save(str(outside / "secret"))
    os.symlink(outside, work / "out" / "linked")  # never followed
    deep = work / "a" / "b" / "c" / "d" / "e"
    _save(str(deep))  # five levels below: beyond the search

    def ls(folder) -> list[str]:
        assert main(["ls", str(folder)]) == 0
        return capsys.readouterr().out.splitlines()

    assert len(ls(work / "ckpts")) == 1 and ls(work / "ckpts")[0].endswith(f"{work}/ckpts/step_100")
    assert "B  " in ls(work / "ckpts")[0]  # its size, as for a complete step
    (line,) = ls(work / "lightning")
    assert line.endswith("lightning/epoch=0-step=10.ckpt"), line
    out = ls(work / "out")
    assert len(out) == 2, out
    assert out[0].endswith("out/checkpoint-8/unickpt") and "B  " in out[0], out
    assert "incomplete" in out[1] and "out/checkpoint-9/unickpt" in out[1], out
    everything = ls(work)
    assert len(everything) == 4 and not any("secret" in x or "/d/e" in x for x in everything), everything
    (tmp_path / "nothing").mkdir()
    (line,) = ls(tmp_path / "nothing")
    assert line.startswith(f"no checkpoint under {tmp_path / 'nothing'}"), line

    assert main(["inspect", str(work / "out" / "checkpoint-8")]) == 1
    err = capsys.readouterr().err
    assert f"{work}/out/checkpoint-8/unickpt: pass that path" in err, err
    word = out[1].split()[1]  # ls's word for the interrupted save
    for command in ("inspect", "verify"):
        assert main([command, str(interrupted)]) == 1
        err = capsys.readouterr().err
        assert f"IncompleteCheckpointError: {interrupted} is {word} (" in err, err
        assert "a save in progress or interrupted" in err and "a save in progress or interrupted" in out[1]
