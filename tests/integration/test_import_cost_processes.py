"""What ``import unickpt`` and the command line's metadata commands import (issue #30 item 5: an
instant CLI). Each check runs in a fresh interpreter (one subprocess per check), since this
pytest process has imported torch long ago:

1. ``import unickpt`` imports no torch (so neither ``torch.distributed.tensor`` nor sympy) and
   no training framework;
2. ``unickpt.cli.main`` runs ``--help``, ``ls``, ``latest``, ``prune --dry-run``, ``inspect``
   (text and ``--json``) and ``verify`` without importing torch, and prints exactly what the same
   commands print here, in a process where torch is loaded;
3. every name of ``unickpt.__all__`` resolves on first access to the object its own module
   defines, ``dir(unickpt)`` lists them all, and ``save`` / ``load`` then round-trip a state bit
   for bit;
4. a process that imported torch first (a job) has, after ``import unickpt``, every unickpt module
   its first ``unickpt.load`` runs (issue #41 item 4: the first load imports nothing on its clock).

No wall time is asserted (``bench/cli_startup.py`` measures it).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt import cli

# modules whose import a metadata command must not pay for
HEAVY = ("torch", "torch.distributed.tensor", "sympy")
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate", "torchtitan", "verl", "megatron")


def _fresh(code: str, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON document last, returned here."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CheckpointManager root: steps 1, 2 and 3 complete (with an optimizer that stepped), a
    foreign folder ``step_00000009`` and the ``latest`` pointer at step 3."""
    path = tmp_path_factory.mktemp("import_cost") / "root"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    manager = unickpt.CheckpointManager(str(path), keep_last=None)
    for step in (1, 2, 3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        manager.save(step, {"model": model, "optimizer": opt, "extra_state": {"step": step}})
    manager.wait()
    (path / "step_00000009").mkdir()
    (path / "step_00000009" / "notes.txt").write_text("not a checkpoint\n")
    return path


def test_import_unickpt_imports_no_torch_and_no_framework() -> None:
    loaded = _fresh(
        f"import json, sys\nimport unickpt\nprint(json.dumps([m for m in {HEAVY + FRAMEWORKS!r} if m in sys.modules]))"
    )
    assert loaded == []


def _commands(root: Path) -> list[list[str]]:
    step = str(root / "step_00000002")
    return [
        ["--help"],
        ["ls", "--help"],
        ["ls", str(root)],
        ["latest", str(root)],
        ["prune", str(root), "--keep-last", "1", "--dry-run"],
        ["inspect", step],
        ["inspect", step, "--json"],
        ["inspect", step, "--summary", "--shards", "weight"],
        ["verify", step],
    ]


# runs each command of argv[1] (a JSON list) through unickpt.cli.main, recording its output, its
# exit code and whether torch was imported by then
_RUN_COMMANDS = """
import contextlib, io, json, sys
from unickpt import cli
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    results.append({"code": code, "out": out.getvalue(), "err": err.getvalue(),
                    "heavy": [m for m in WATCHED if m in sys.modules]})
print(json.dumps(results))
""".replace("WATCHED", repr(HEAVY + FRAMEWORKS))


def _run_here(argv: list[str]) -> dict:
    """The same command in this process (torch loaded)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


def _untimed(result: dict) -> dict:
    """``result`` without the seconds ``verify`` reports (``... bytes in 0.01 s)``)."""
    return {
        k: re.sub(r" in [0-9]+\.[0-9]+ s\)", " in <t> s)", v) if isinstance(v, str) else v for k, v in result.items()
    }


def test_metadata_commands_run_without_torch_and_print_the_same(root: Path) -> None:
    commands = _commands(root)
    fresh = _fresh(_RUN_COMMANDS, json.dumps(commands))
    for argv, got in zip(commands, fresh, strict=True):
        assert got.pop("heavy") == [], argv
        assert _untimed(got) == _untimed(_run_here(argv)), argv
    # the commands did their work (not an error line each)
    assert all(r["code"] == 0 and r["err"] == "" for r in fresh)
    ls, latest, prune = fresh[2]["out"], fresh[3]["out"], fresh[4]["out"]
    assert latest == f"{root / 'step_00000003'}\n"
    assert "would delete 2 checkpoint(s): steps [1, 2]" in prune
    assert "foreign" in ls and "<- latest" in ls
    assert json.loads(fresh[6]["out"])["totals"]["tensors"] > 2
    assert ": OK: " in fresh[8]["out"]


_RESOLVE = """
import importlib, json, sys, types
import torch
import unickpt
names = list(unickpt.__all__)
wrong, missing_dir = [], sorted(set(names) - set(dir(unickpt)))
lazy_before = [n for n in names if n in vars(unickpt)]
for name in names:
    value = getattr(unickpt, name)
    if isinstance(value, types.ModuleType):
        home = importlib.import_module(value.__name__)
        ok = home is value and value.__name__.startswith("unickpt.")
    else:
        ok = getattr(importlib.import_module(value.__module__), name, None) is value
    if not ok:
        wrong.append(name)
namespace = {}
exec("from unickpt import *", namespace)
star_missing = sorted(set(names) - set(namespace))
model = torch.nn.Linear(3, 2)
state = {"model": model, "extra_state": {"step": 7}}
unickpt.save(sys.argv[1], state)
other = torch.nn.Linear(3, 2)
back = {"model": other, "extra_state": {}}
unickpt.load(sys.argv[1], back)
exact = all(
    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in zip(model.state_dict().values(), other.state_dict().values())
)
print(json.dumps({"wrong": wrong, "missing_dir": missing_dir, "star_missing": star_missing,
                  "lazy_before": lazy_before, "exact": exact, "step": back["extra_state"].get("step")}))
"""


def test_every_public_name_resolves_lazily_and_save_load_work(tmp_path: Path) -> None:
    got = _fresh(_RESOLVE, str(tmp_path / "ckpt"))
    assert got["wrong"] == [] and got["missing_dir"] == [] and got["star_missing"] == []
    # resolved on access, not at import: only the cheap modules are bound by ``import unickpt``
    assert not {"save", "load", "Checkpointer", "CheckpointManager", "PerRank"} & set(got["lazy_before"])
    assert got["exact"] is True and got["step"] == 7


# argv[1]: a checkpoint of {"model": Linear(3, 2)}; prints the modules the first load imported
# of unickpt, of awscrt (the CRC32C: its import seeds a random generator, tens of ms) and of
# torch's FSDP (the framework's detection: no model of a process that never imported it is wrapped)
_FIRST_LOAD = """
import json, sys
import torch
import unickpt
before = set(sys.modules)
model = torch.nn.Linear(3, 2)
unickpt.load(sys.argv[1], {"model": model})
watched = ("unickpt", "awscrt", "torch.distributed.fsdp")
print(json.dumps({"imported": sorted(m for m in set(sys.modules) - before if m.startswith(watched))}))
"""


def test_issue41_item4_a_job_that_imported_torch_has_what_a_load_runs_before_its_first_load(tmp_path: Path) -> None:
    """A job imports torch, then unickpt: ``import unickpt`` brings the load machinery in then,
    so the first ``unickpt.load`` (a restart's critical path) imports no unickpt module, nor the
    CRC32C library, nor torch's FSDP package for a model that is not wrapped by FSDP."""
    path = str(tmp_path / "ckpt")
    unickpt.save(path, {"model": torch.nn.Linear(3, 2)})
    got = _fresh(_FIRST_LOAD, path)
    assert got["imported"] == []
