"""Names read from a checkpoint are printed escaped (issue 26, item 9, CLI side): a metadata
forged to hold ``ESC [31m`` and ``U+202E`` (right-to-left override) in a tensor key never sends
those characters to the terminal, from any command that prints names; the escaped form
(``\\x1b``, ``\\u202e``) is shown instead. Also ``--key`` of ``inspect`` and ``diff`` are both
regular expressions (item 15)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt import cli
from unickpt.format import METADATA_FILE
from unickpt.ops.printable import printable

EVIL = "model.\x1b[31mred\u202egpj.w"
SHOWN = "model.\\x1b[31mred\\u202egpj.w"  # what the terminal must show instead


def _save(path: Path) -> None:
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4), "b": torch.randn(5)}
    model = torch.nn.ParameterDict({k: torch.nn.Parameter(v) for k, v in params.items()})
    unickpt.save(str(path), {"model": model}).wait()


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("names")
    good, bad = root / "good", root / "bad"
    _save(good)
    shutil.copytree(good, bad)
    md = json.loads((bad / METADATA_FILE).read_text())
    md["tensors"] = {(EVIL if k == "model.w" else k): v for k, v in md["tensors"].items()}
    (bad / METADATA_FILE).write_text(json.dumps(md))
    return good, bad


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out + err


def _clean(text: str) -> bool:
    return "\x1b" not in text and "\u202e" not in text


def test_printable_escapes_controls_bidi_and_surrogates_only() -> None:
    assert printable("plain.weight é ü 日本") == "plain.weight é ü 日本"
    assert printable(EVIL) == SHOWN
    assert printable("a\nb\tc\x00d\x7fe\u200bf\u2066g\u2028h") == "a\\x0ab\\x09c\\x00d\\x7fe\\u200bf\\u2066g\\u2028h"
    assert printable(os.fsdecode(b"ck\xff")) == "ck\\udcff"
    assert printable("x\U000e0001y") == "x\\U000e0001y"  # a tag character (format)
    assert printable("a\\b") == "a\\b"  # a safe name is shown as it is, backslash included
    assert printable("a\\x1b\x1b") == "a\\\\x1b\\x1b"  # else backslashes are escaped too: no look-alike


def test_every_command_prints_forged_names_escaped(
    forged: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = forged
    for args in (
        ("inspect", str(bad)),
        ("inspect", str(bad), "--key", "red"),
        ("inspect", str(bad), "--shards", EVIL),
        ("inspect", str(bad), "--values", EVIL),
        ("diff", str(bad), str(good)),
        ("diff", str(good), str(bad)),
    ):
        code, text = _run(capsys, *args)
        assert _clean(text), (args, text)
        assert SHOWN in text, (args, code, text)
    code, text = _run(capsys, "inspect", str(bad), "--json")
    assert code == 0 and _clean(text) and EVIL in [t["fqn"] for t in json.loads(text)["tensors"]]
    code, text = _run(capsys, "merge", str(bad), str(tmp_path / "merged"))
    assert code == 0 and _clean(text), text


def test_verify_failures_print_forged_names_escaped(
    forged: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, bad = forged
    copy = tmp_path / "bad"
    shutil.copytree(bad, copy)
    for f in sorted(p for p in (copy / "data").rglob("*") if p.is_file()):
        raw = bytearray(f.read_bytes())
        raw[0] ^= 0xFF
        f.write_bytes(bytes(raw))
    for command in ("verify", "inspect"):
        args = (command, str(copy)) + (("--verify",) if command == "inspect" else ())
        code, text = _run(capsys, *args)
        assert code == 1 and _clean(text) and "ChecksumMismatchError" in text, text
        assert "\\x1b[31mred\\u202egpj" in text, text


def test_error_lines_escape_names(
    forged: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name inside an error message (a data file missing under the forged key)."""
    _, bad = forged
    copy = tmp_path / "bad"
    shutil.copytree(bad, copy)
    for f in (p for p in (copy / "data").rglob("*") if p.is_file()):
        f.unlink()
    code, text = _run(capsys, "inspect", str(copy), "--values", EVIL)
    assert code == 1 and _clean(text) and len(text.strip().splitlines()) >= 1, text
    err_line = text.strip().splitlines()[-1]
    assert err_line.startswith("unickpt inspect: error: MissingDataFileError") and SHOWN in err_line, text


def test_key_is_a_regex_for_inspect_and_diff(
    forged: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, _ = forged
    other = tmp_path / "other"
    shutil.copytree(good, other)
    md = json.loads((other / METADATA_FILE).read_text())
    md["tensors"] = {("model.x" if k == "model.b" else k): v for k, v in md["tensors"].items()}
    (other / METADATA_FILE).write_text(json.dumps(md))
    # "^model\.b$" matches model.b only as a regex (as a substring it matches nothing)
    code, text = _run(capsys, "diff", str(good), str(other), "--key", r"^model\.b$")
    assert code == 1 and "only in A: model.b" in text and "model.x" not in text, text
    code, text = _run(capsys, "diff", str(good), str(other), "--key", r"\.w$")
    assert code == 0 and "identical: 1 tensors equal" in text, text
    code, text = _run(capsys, "inspect", str(good), "--key", r"\.w$")
    rows = [x.split()[0] for x in text.splitlines() if x.startswith("  model.")]
    assert code == 0 and rows == ["model.w"], text
