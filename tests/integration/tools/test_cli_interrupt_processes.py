"""Ctrl-C (a real SIGINT to a real process) at any moment of a ``unickpt`` command (issue 39, item 14):
one line on stderr, ``unickpt <command>: interrupted``, exit status 130, never a traceback.

The command runs as the console script pip generates from this checkout's ``pyproject.toml``
(``[project.scripts]``), so the entry module is the one a user's ``unickpt`` runs. The moments come
from the process itself: a ``sitecustomize`` of the test adds an audit hook that reports on a pipe
when the import of a chosen module begins (the ``import`` audit event). The moments: the start of
the import of the ``unickpt`` package, its CLI, numpy, torch (for ``merge`` torch is imported while
argparse parses, by the type of ``--max-shard-size``), and delays of 0.05 to 2 s after the import
of the package began (the imports, the parsing, the command). The entry module (``_unickpt_cli``)
installs its handler before that import; before its first lines run the interpreter is starting,
which no code of unickpt can cover (its docstring). A command that finished before its signal
was due reports its normal exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import unickpt

REPO = Path(__file__).resolve().parents[3]
DELAYS = (0.05, 0.2, 0.5, 1.0, 2.0)
ENTRY = "unickpt"  # the delays count from here: the entry module has installed its handler
MARKERS = ("unickpt", "unickpt.cli", "numpy", "torch")
# the child's sitecustomize: "<module>\n" on fd $UNICKPT_TEST_IMPORT_FD as the import of each of
# $UNICKPT_TEST_IMPORTS begins (test instrumentation only: it never touches stderr)
SITECUSTOMIZE = """
import os, sys
_fd = int(os.environ["UNICKPT_TEST_IMPORT_FD"])
_names = set(os.environ["UNICKPT_TEST_IMPORTS"].split(","))
def _hook(event, args):
    if event == "import" and args[0] in _names:
        _names.discard(args[0])
        try:
            os.write(_fd, (args[0] + "\\n").encode())
        except OSError:
            pass
sys.addaudithook(_hook)
"""


@dataclass(frozen=True)
class Run:
    moment: str
    sent: bool  # False: the command had exited before the signal was due
    returncode: int
    stderr: str


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A console script generated as pip does from pyproject.toml, a CheckpointManager root with
    one step, and that step's checkpoint."""
    tmp = tmp_path_factory.mktemp("cli_interrupt")
    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["unickpt"]
    module, func = entry.split(":")
    (tmp / "hook").mkdir()
    (tmp / "hook" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    script = tmp / "unickpt"
    script.write_text(
        f"import sys\nfrom {module} import {func}\nif __name__ == '__main__':\n"
        f"    sys.argv[0] = sys.argv[0].removesuffix('.exe')\n    sys.exit({func}())\n"
    )
    torch.manual_seed(0)
    manager = unickpt.CheckpointManager(str(tmp / "run"))
    manager.save(1, {"model": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))})
    (ck,) = manager.list_checkpoints()
    return {"script": script, "root": tmp / "run", "ck": Path(ck.path), "tmp": tmp, "hook": tmp / "hook"}


def _commands(f: dict[str, Path], out: str) -> dict[str, list[str]]:
    ck = str(f["ck"])
    return {
        "merge": ["merge", ck, str(f["tmp"] / f"merged-{out}")],
        "convert": ["convert", "--to", "dcp", ck, str(f["tmp"] / f"dcp-{out}")],
        "diff": ["diff", ck, ck],
        "inspect": ["inspect", ck],
        "ls": ["ls", str(f["root"])],
    }


def _start(script: Path, argv: list[str], hook: Path, fd_var: str, **env_vars: str) -> tuple[subprocess.Popen, int]:
    """The console script with ``argv``, the folder ``hook`` (its ``sitecustomize``) first on its
    path, stderr piped; the write end of a new pipe passed to it in ``$fd_var``. Returns the
    process and the pipe's read end."""
    read, write = os.pipe()
    env = dict(os.environ, PYTHONWARNINGS="ignore", **env_vars)
    env[fd_var] = str(write)
    env["PYTHONPATH"] = os.pathsep.join([str(hook), str(REPO / "src"), env.get("PYTHONPATH", "")])
    try:
        p = subprocess.Popen(
            [sys.executable, str(script), *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            pass_fds=(write,),
        )
    finally:
        os.close(write)
    return p, read


def _interrupt(f: dict[str, Path], argv: list[str], moment: str) -> Run:
    """Start the command, send SIGINT at ``moment``: when the import of a ``MARKERS`` module
    begins, or a delay in seconds after the import of ``ENTRY`` began."""
    marker = moment if moment in MARKERS else ENTRY
    p, read = _start(f["script"], argv, f["hook"], "UNICKPT_TEST_IMPORT_FD", UNICKPT_TEST_IMPORTS=marker)
    with os.fdopen(read, "rb") as began:
        seen = began.readline()  # blocks until that import begins (b"": the process exited first)
    if seen and moment not in MARKERS:
        try:
            p.wait(timeout=float(moment))  # the command may finish first
        except subprocess.TimeoutExpired:
            pass
    sent = p.poll() is None
    if sent:
        p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=180)
    return Run(moment, sent, p.returncode, stderr.decode(errors="replace"))


@pytest.mark.parametrize("command", ["merge", "convert", "diff", "inspect", "ls"])
def test_issue39_item14_ctrl_c_at_any_moment_is_one_line_and_130(folders: dict[str, Path], command: str) -> None:
    moments = [str(d) for d in DELAYS] + list(MARKERS)
    with ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(lambda m: _interrupt(folders, _commands(folders, m)[command], m), moments))
    interrupted = 0
    for run in runs:
        if run.returncode == 130:
            # the one line, after any whole progress line the command wrote before the signal
            # (merge reports each file it wrote; a signal after the last one still interrupts)
            *before, last = run.stderr.split("\n")[:-1] or [""]
            assert run.sent and run.stderr.endswith("\n") and last == f"unickpt {command}: interrupted", run
            assert all(line.startswith(f"unickpt {command}: wrote ") for line in before), run
            interrupted += 1
        else:  # the command had finished its work before the signal (or never imports torch)
            assert run.returncode == 0, run
            # its normal output only: progress lines of the command (merge reports each file), no
            # traceback and no "interrupted"
            lines = run.stderr.splitlines()
            assert all(line.startswith(f"unickpt {command}: wrote ") for line in lines), run
            assert not run.sent or run.moment not in ("0.05", "unickpt", "unickpt.cli", "numpy"), run
    assert interrupted >= 5, runs  # the early moments always interrupt


# the child's sitecustomize for the deferral test: a SIGINT to itself as the import of
# torch.autograd begins (inside ``import torch``, from within torch.nn's import), and, at exit, on
# fd $UNICKPT_TEST_REPORT_FD whether torch's own imports ran to their end ("whole": torch.nn and
# torch.distributed, which torch imports after that point, were imported)
SELF_INTERRUPT = """
import atexit, os, signal, sys
_fd = int(os.environ["UNICKPT_TEST_REPORT_FD"])
_sent = []
def _hook(event, args):
    if event == "import" and args[0] == "torch.autograd" and not _sent:
        _sent.append(1)
        os.kill(os.getpid(), signal.SIGINT)
sys.addaudithook(_hook)
def _report():
    whole = "torch.nn" in sys.modules and "torch.distributed" in sys.modules
    os.write(_fd, (f"sent={len(_sent)} whole={whole}\\n").encode())
atexit.register(_report)
"""


def test_a_ctrl_c_inside_the_import_of_torch_is_raised_when_that_import_returns(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """A SIGINT delivered while torch is being imported (its native initialisers call back into
    Python, and an exception raised there aborted the process: SIGABRT, seen in CI) is deferred
    to the end of that import: torch's own imports run to their end, then the command stops with
    the one line and 130 (the import of torch itself fails with the KeyboardInterrupt, as a
    Ctrl-C during any import does)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SELF_INTERRUPT)
    argv = ["convert", "--to", "dcp", str(folders["ck"]), str(tmp_path / "out")]
    p, read = _start(folders["script"], argv, hook, "UNICKPT_TEST_REPORT_FD")
    _, stderr = p.communicate(timeout=180)
    with os.fdopen(read, "rb") as report:
        said = report.read().decode()
    assert said == "sent=1 whole=True\n"  # the signal came inside the import, which still finished
    assert p.returncode == 130
    assert stderr.decode() == "unickpt convert: interrupted\n"
    assert not (tmp_path / "out").exists()  # stopped before the command wrote anything
