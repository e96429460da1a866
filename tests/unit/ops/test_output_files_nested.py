"""Issue 39 item 16: ``merge``, ``convert`` and ``modify`` refuse an output folder inside their source
(today ``unickpt merge CK CK/inside`` writes into the checkpoint) and a source inside their output,
with paths resolved (a link to the checkpoint, ``..``), before anything is read or written: an
``OutputInsideSourceError`` (a ``ConfigurationError``), one line from the CLI."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import unickpt
from unickpt.cli import main
from unickpt.errors import ConfigurationError
from unickpt.ops.convert import from_dcp, to_dcp
from unickpt.ops.merge import merge
from unickpt.ops.modify import modify


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "ck"
    unickpt.save(str(path), {"model": torch.nn.Linear(3, 2)})
    return path


def _refused(call, source: Path) -> str:
    before = _tree(source)
    with pytest.raises(ConfigurationError) as info:
        call()
    assert type(info.value).__name__ == "OutputInsideSourceError"
    assert _tree(source) == before  # nothing written into the source
    return str(info.value)


@pytest.mark.parametrize(
    "write",
    [
        merge,
        lambda src, out: merge(src, out, fmt="torch"),
        to_dcp,
        lambda src, out: to_dcp(src, out, layout="torchtitan"),
        modify,
    ],
    ids=["merge", "merge-torch", "to-dcp", "to-dcp-torchtitan", "modify"],
)
def test_issue39_item16_output_inside_source_is_refused(ck, tmp_path, write):
    message = _refused(lambda: write(str(ck), str(ck / "inside")), ck)
    assert f"{ck / 'inside'}" in message and "inside the source" in message
    _refused(lambda: write(str(ck), str(ck / "data" / "x")), ck)  # deeper, into unickpt's own data folder
    _refused(lambda: write(str(ck), str(ck)), ck)  # the source itself
    link = tmp_path / "latest"  # ckpts/latest -> step_100: resolved before comparing
    link.symlink_to(ck, target_is_directory=True)
    _refused(lambda: write(str(ck), str(link / "inside")), ck)
    _refused(lambda: write(str(link), str(tmp_path / "other" / ".." / "ck" / "inside")), ck)
    write(str(ck), str(tmp_path / "ck-out"))  # beside it: fine


def test_issue39_item16_source_inside_output_is_refused(tmp_path):
    out = tmp_path / "out"
    source = out / "ck"
    unickpt.save(str(source), {"model": torch.nn.Linear(3, 2)})
    for call in (lambda: merge(str(source), str(out)), lambda: to_dcp(str(source), str(out))):
        message = _refused(call, out)
        assert "is inside the output folder" in message


def test_issue39_item16_convert_from_dcp_into_its_source_is_refused(tmp_path):
    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    _refused(lambda: from_dcp(str(folder), str(folder / "imported")), folder)


@pytest.mark.parametrize("command", [["merge"], ["convert", "--to", "dcp"], ["modify"]])
def test_issue39_item16_cli_says_it_in_one_line(ck, capsys, command):
    before = _tree(ck)
    code = main([*command, str(ck), os.path.join(str(ck), "inside")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "OutputInsideSourceError" in err[0], err
    assert _tree(ck) == before
