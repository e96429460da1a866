"""The integrations' "delete this checkpoint" (``integrations._delete.delete_checkpoint``, what a
trainer's keep-the-best-k calls): only unickpt's own files go, and a path that is a link is
never followed. One process, no framework."""

from __future__ import annotations

import os

import torch

import unickpt
from unickpt.integrations._delete import delete_checkpoint


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_a_link_to_a_checkpoint_is_not_followed(tmp_path) -> None:
    ck = str(tmp_path / "ck")
    unickpt.save(ck, {"model": torch.nn.Linear(2, 2)})
    before = _files(ck)
    assert "unickpt.metadata.json" in before
    link = str(tmp_path / "last")
    os.symlink(ck, link)
    assert delete_checkpoint(link) is False
    assert delete_checkpoint(link + os.sep) is False
    assert _files(ck) == before  # the checkpoint the link points to is whole
    assert os.path.islink(link)


def test_only_unickpts_files_go_and_the_folder_stays_for_the_users_file(tmp_path) -> None:
    ck = str(tmp_path / "ck")
    unickpt.save(ck, {"model": torch.nn.Linear(2, 2)})
    with open(os.path.join(ck, "notes.txt"), "w") as f:
        f.write("the user's")
    assert delete_checkpoint(ck) is True
    assert _files(ck) == ["notes.txt"]
    os.remove(os.path.join(ck, "notes.txt"))
    unickpt.save(ck, {"model": torch.nn.Linear(2, 2)})
    assert delete_checkpoint(ck) is True
    assert not os.path.exists(ck)  # nothing of the user's left: the folder goes too
