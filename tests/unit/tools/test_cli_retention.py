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
