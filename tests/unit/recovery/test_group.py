"""The same fault, the same error on every rank (issue 40 item 1), without processes: the RAM
tier's ``TierGroup.fail_together`` over simulated ranks (each rank's gather answered with every
rank's contribution), and the per-step folder check ``folders.step_folder_problem``."""

from __future__ import annotations

import errno
import os

import pytest

from unickpt.errors import (
    ConfigurationError,
    IntegrityError,
    InternalError,
    NotACheckpointError,
    StorageError,
    UnsafePathError,
)
from unickpt.recovery.folders import step_folder_problem
from unickpt.recovery.group import TierGroup, family_of

HOSTS = ("a", "b", "c")


class _Gathered(Exception):
    def __init__(self, obj: object) -> None:
        self.obj = obj


class _Rank(TierGroup):
    """Rank ``rank`` of a simulated 3-rank tier group: ``all_gather`` answers with ``others``
    (every rank's contribution; None: record this rank's and stop)."""

    others: list[object] | None = None

    def all_gather(self, obj: object) -> list[object]:
        if self.others is None:
            raise _Gathered(obj)
        return [obj if r == self.rank else o for r, o in enumerate(self.others)]


def _rank(r: int) -> _Rank:
    return _Rank(None, r, 3, HOSTS[r], HOSTS, HOSTS, {h: i for i, h in enumerate(HOSTS)}, {})


def _every_rank(errors: list[BaseException | None]) -> list[BaseException | None]:
    """Each rank's outcome of ``fail_together(errors[rank], "phase")``."""
    sent = []
    for r, e in enumerate(errors):
        with pytest.raises(_Gathered) as got:
            _rank(r).fail_together(e, "phase", obj=r)
        sent.append(got.value.obj)
    out: list[BaseException | None] = []
    for r, e in enumerate(errors):
        g = _rank(r)
        object.__setattr__(g, "others", sent)
        try:
            assert g.fail_together(e, "phase", obj=r) == [0, 1, 2]
            out.append(None)
        except Exception as raised:
            out.append(raised)
    return out


def test_issue40_item1_one_ranks_error_is_the_same_error_on_every_rank():
    link = UnsafePathError(errno.ELOOP, "/ram/b/job/replicas/a is a symbolic link")
    out = _every_rank([None, link, None])
    assert [type(e) for e in out] == [StorageError] * 3
    want = f"phase: host b (rank 1): UnsafePathError: [Errno {errno.ELOOP}] /ram/b/job/replicas/a is a symbolic link"
    assert {str(e) for e in out} == {want}
    assert out[1].__cause__ is link and out[0].__cause__ is None


def test_issue40_item1_the_cause_family_wins_over_what_it_caused_on_other_ranks():
    crc = IntegrityError("replica of b:step_00000002/x.bin: chunk(s) [0] failed CRC32C on arrival")
    unsafe = ConfigurationError("/ram/b/job/step_00000002/x.bin is a symbolic link")
    out = _every_rank([crc, unsafe, None])
    assert [type(e) for e in out] == [ConfigurationError] * 3
    assert len({str(e) for e in out}) == 1
    assert str(out[0]) == f"phase: host a (rank 0): {crc}; host b (rank 1): {unsafe}"


def test_issue40_item1_no_error_anywhere_returns_every_ranks_gather():
    assert _every_rank([None, None, None]) == [None, None, None]


@pytest.mark.parametrize(
    ("error", "family"),
    [
        (OSError(errno.EACCES, "denied"), StorageError),
        (UnsafePathError(errno.ELOOP, "link"), StorageError),
        (NotACheckpointError("gone"), IntegrityError),
        (ConfigurationError("x"), ConfigurationError),
        (KeyError("bug"), InternalError),
    ],
)
def test_issue40_item1_family_of_a_ranks_error(error, family):
    assert family_of(error) is family


def test_issue40_item1_step_folder_problem_finds_links_in_the_steps_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("UNICKPT_SHM_ROOT", str(tmp_path / "shm"))
    root = tmp_path / "shm" / f"unickpt-{os.getuid()}" / "job"
    data = root / "step_00000002" / "data" / "sid"
    data.mkdir(parents=True, mode=0o700)
    for p in (tmp_path / "shm" / f"unickpt-{os.getuid()}", root, root / "step_00000002", data.parent, data):
        p.chmod(0o700)
    (data / "r00000-00.bin").write_bytes(b"x")
    (root / "step_00000002" / "notes.txt").write_text("a foreign file: passes")
    outside = tmp_path / "outside"
    outside.mkdir()
    assert step_folder_problem("shmnode://job", "step_00000002", ["a"]) is None
    (data / "r00000-01.bin").symlink_to(outside / "x")  # a link in a file's place
    problem = step_folder_problem("shmnode://job", "step_00000002", ["a"])
    assert problem is not None and problem.startswith(f"{data / 'r00000-01.bin'} is a symbolic link;"), problem
    (data / "r00000-01.bin").unlink()
    (root / "replicas" / "a").mkdir(parents=True, mode=0o700)
    (root / "replicas").chmod(0o700)
    (root / "replicas" / "a" / "step_00000002").symlink_to(outside)  # a replica step folder: a link
    problem = step_folder_problem("shmnode://job", "step_00000002", ["a"])
    assert problem is not None and problem.startswith(
        f"{root / 'replicas' / 'a' / 'step_00000002'} is a symbolic link;"
    )
    assert step_folder_problem("shmnode://job", "step_00000002", []) is None  # b holds no replica of a
