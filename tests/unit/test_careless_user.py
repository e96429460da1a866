"""What a careless user hit (issue 26 items 9-11): names that rewrite a terminal, torchrun without
a process group, ``~`` in a path and a path that does not exist. Single-process tests; the
torchrun case runs in a subprocess with the launcher's environment and no process group.

Its tests that start processes are in ``tests/integration/test_careless_user_processes.py``."""

from __future__ import annotations

import unicodedata

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import unickpt
from unickpt.errors import NoProcessGroupError, NotACheckpointError, UnsafeNameError
from unickpt.format import printable

# characters a name may not hold, one of each kind the issue names (written out, not derived)
BAD = {
    "NUL": "\x00",
    "ESC (ANSI)": "\x1b",
    "newline": "\n",
    "DEL": "\x7f",
    "C1 CSI": "\x9b",
    "RLO": "\u202e",
    "LRE": "\u202a",
    "RLI": "\u2067",
    "PDI": "\u2069",
    "LRM": "\u200e",
    "RLM": "\u200f",
    "zero-width space": "\u200b",
    "line separator": "\u2028",
}


class Named(torch.nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.register_buffer(name, torch.arange(3.0))


# ---------------------------------------------------------------- item 9: names


@pytest.mark.parametrize("kind", sorted(BAD))
def test_item9_tensor_names_with_control_or_bidi_characters_are_refused_before_writing(tmp_path, kind):
    name = f"w{BAD[kind]}x"
    with pytest.raises(UnsafeNameError) as ei:
        unickpt.save(str(tmp_path / "ck"), {"model": Named(name)}, framework="torch")
    msg = str(ei.value)
    assert BAD[kind] not in msg  # the message itself is safe to print
    assert f"model.w{_escaped(BAD[kind])}x" in msg, msg
    assert isinstance(ei.value, ValueError)
    assert not (tmp_path / "ck").exists()  # nothing written


@pytest.mark.parametrize("kind", ["ESC (ANSI)", "RLO", "NUL"])
def test_item9_extra_state_keys_are_refused_too(tmp_path, kind):
    state = {"model": Named("w"), "extra_state": {f"step{BAD[kind]}": 1}}
    with pytest.raises(UnsafeNameError, match="extra_state key") as ei:
        unickpt.save(str(tmp_path / "ck"), state, framework="torch")
    assert f"step{_escaped(BAD[kind])}" in str(ei.value)
    assert not (tmp_path / "ck").exists()


def test_item9_ordinary_names_still_save(tmp_path):
    """Unicode letters, spaces and punctuation are names like any other; values deeper inside
    extra_state (data, not names) keep their control characters."""
    model = Named("gewicht_é_層 1")
    state = {"model": model, "extra_state": {"vocab": {"\n": 1, "\x1b": 2}, "ünï code": 3}}
    unickpt.save(str(tmp_path / "ck"), state, framework="torch")
    back = Named("gewicht_é_層 1")
    back.get_buffer("gewicht_é_層 1").zero_()
    loaded = {"model": back, "extra_state": {}}
    unickpt.load(str(tmp_path / "ck"), loaded, framework="torch")
    assert torch.equal(back.get_buffer("gewicht_é_層 1"), torch.arange(3.0))
    assert loaded["extra_state"] == {"vocab": {"\n": 1, "\x1b": 2}, "ünï code": 3}


def _escaped(c: str) -> str:
    """The escape the issue asks for, written out from the code point (Python's notation)."""
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


@given(
    st.text(max_size=12)
    | st.builds(
        lambda a, c, b: a + c + b, st.text(max_size=4), st.sampled_from(sorted(BAD.values())), st.text(max_size=4)
    )
)
def test_item9_printable_is_safe_and_unambiguous(name):
    """No character of the refused kinds (categories Cc, Cf, Zl, Zp) is ever printed, and the
    escapes decode back to the name (so two names never print alike)."""
    shown = printable(name)
    assert not any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in shown)
    if shown == name:
        return
    assert any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in name)
    assert shown.encode("ascii", "backslashreplace").decode("unicode_escape") == name


# ---------------------------------------------------------------- item 10: torchrun, no process group


def test_item10_a_single_process_job_is_unaffected(tmp_path, monkeypatch):
    for world in ("1", ""):
        monkeypatch.setenv("WORLD_SIZE", world)
        unickpt.save(str(tmp_path / f"ck{world}"), {"model": Named("w")}, framework="torch")
    assert issubclass(NoProcessGroupError, RuntimeError)


# ---------------------------------------------------------------- item 11: "~" and missing paths


def test_item11_tilde_is_the_home_folder(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    unickpt.save("~/ckpts/step_1", {"model": Named("w")}, framework="torch")
    assert list(cwd.iterdir()) == []  # no literal "./~"
    assert (home / "ckpts" / "step_1" / "unickpt.metadata.json").is_file()
    back = Named("w")
    back.get_buffer("w").zero_()
    unickpt.load("~/ckpts/step_1", {"model": back}, framework="torch")
    assert torch.equal(back.get_buffer("w"), torch.arange(3.0))
    manager = unickpt.CheckpointManager("~/run", keep_last=2)
    manager.save(3, {"model": Named("w")}, framework="torch").wait()
    assert (home / "run" / "step_00000003" / "unickpt.metadata.json").is_file()
    assert list(cwd.iterdir()) == []


def test_item11_a_missing_path_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "no_such_run" / "step_1"
    with pytest.raises(NotACheckpointError) as ei:
        unickpt.load(str(missing), {"model": Named("w")}, framework="torch")
    assert str(ei.value).endswith(f"no checkpoint at {missing} (it does not exist)"), str(ei.value)
    assert not missing.parent.exists()  # a load creates nothing
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotACheckpointError, match="is not a unickpt checkpoint") as ei:
        unickpt.load(str(empty), {"model": Named("w")}, framework="torch")
    assert "does not exist" not in str(ei.value)
