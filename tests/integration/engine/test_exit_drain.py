"""Issue 9 item 1: a script that ends while an asynchronous save is still running must not lose it.

Each test runs a real script in a fresh interpreter (one process, or two ranks started by
``torch.distributed.run`` exactly as ``torchrun`` does). The script saves asynchronously into a
``slowexit://`` folder: a local folder whose first storage call from a unickpt thread waits until
the interpreter has begun to shut down (and leaves a marker file saying so), so the save provably
still runs while the interpreter shuts down. The checkpoint must then be committed and load bit
for bit; a save that cannot finish (the process group destroyed under it) must make the process
exit non-zero with a message on stderr naming the checkpoint and what to do.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import unickpt
from tests.workers.harness import free_port

_PRELUDE = textwrap.dedent('''
    import os, sys, threading, time
    import torch
    import torch.distributed as dist
    import unickpt
    from unickpt.storage import register_storage
    from unickpt.storage.local import LocalStorage

    OUT = sys.argv[1]
    RANK = int(os.environ.get("RANK", "0"))
    _gate = {"passed": False}


    def _wait_for_main_thread_end():
        """Called on every public storage call: the first one made by a unickpt thread (the save
        worker or its writers) waits until the interpreter has begun to shut down (the script's
        code has ended), then leaves a marker proving it. (``threading._SHUTTING_DOWN``: a
        test-only use of a private flag; if Python drops it, this raises and the test fails.)"""
        if _gate["passed"] or threading.current_thread() is threading.main_thread():
            return
        deadline = time.monotonic() + 120
        while not threading._SHUTTING_DOWN:
            if time.monotonic() > deadline:
                raise TimeoutError("the interpreter never began to shut down")
            time.sleep(0.01)
        _gate["passed"] = True
        with open(os.path.join(OUT, f"marker-rank{RANK}"), "w") as f:
            f.write("the save was still running when the interpreter began to shut down")


    class SlowAtExit(LocalStorage):
        def __getattribute__(self, name):
            value = super().__getattribute__(name)
            if not name.startswith("_") and callable(value):
                _wait_for_main_thread_end()
            return value


    register_storage("slowexit", SlowAtExit, replace=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    state = {"model": model, "optimizer": optim, "extra_state": {"step": 7}}
    if RANK == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(OUT, "ref.pt"))
''')

_SINGLE = _PRELUDE + textwrap.dedent("""
    unickpt.save(f"slowexit://{OUT}/ckpt", state, framework="torch", async_save=True)
""")

_MANAGER = _PRELUDE + textwrap.dedent("""
    manager = unickpt.CheckpointManager(f"slowexit://{OUT}/root", keep_last=2)
    _gate["passed"] = True  # no gate for the first, blocking save
    manager.save(1, {"model": torch.nn.Linear(2, 2)}, framework="torch")
    _gate["passed"] = False
    manager.save(2, state, framework="torch", async_save=True)
""")

_TWO_RANKS = _PRELUDE + textwrap.dedent("""
    dist.init_process_group("gloo")
    unickpt.save(f"slowexit://{OUT}/ckpt", state, framework="ddp", async_save=True)
    if sys.argv[2] == "destroy":
        dist.destroy_process_group()  # also destroys unickpt's groups: the save cannot finish
""")


def _run(script: str, out: Path, *args: str, ranks: int = 0) -> subprocess.CompletedProcess[str]:
    path = out / "script.py"
    path.write_text(script)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if ranks:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={ranks}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(path),
            str(out),
            *args,
        ]
    else:
        cmd = [sys.executable, str(path), str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _loads_bit_exact(path: str, out: Path) -> None:
    ref = torch.load(out / "ref.pt", weights_only=True)
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    state: dict = {"model": model, "extra_state": None}
    unickpt.load(path, state, framework="torch", strict=False)
    got = model.state_dict()
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert state["extra_state"] == {"step": 7}


def test_issue9_item1_async_save_running_at_exit_commits(tmp_path):
    proc = _run(_SINGLE, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "marker-rank0").exists(), "the save did not overlap the interpreter's exit"
    _loads_bit_exact(str(tmp_path / "ckpt"), tmp_path)


def test_issue9_item1_manager_save_running_at_exit_commits(tmp_path):
    proc = _run(_MANAGER, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "marker-rank0").exists(), "the save did not overlap the interpreter's exit"
    manager = unickpt.CheckpointManager(str(tmp_path / "root"))
    assert manager.read_pointer() is not None and manager.read_pointer().step == 2
    _loads_bit_exact(manager.path_for(2), tmp_path)


def test_issue9_item1_two_ranks_under_torchrun_commit_at_exit(tmp_path):
    proc = _run(_TWO_RANKS, tmp_path, "keep", ranks=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "marker-rank0").exists() and (tmp_path / "marker-rank1").exists()
    _loads_bit_exact(str(tmp_path / "ckpt"), tmp_path)


def test_issue9_item1_save_lost_to_destroy_process_group_fails_loudly(tmp_path):
    proc = _run(_TWO_RANKS, tmp_path, "destroy", ranks=2)
    assert proc.returncode != 0, proc.stderr[-4000:]
    err = proc.stderr
    assert f"{tmp_path}/ckpt" in err and "unickpt.wait_all()" in err and "destroy_process_group" in err, err[-4000:]
    assert not (tmp_path / "ckpt" / "unickpt.metadata.json").exists()


_HOOK = textwrap.dedent("""
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from unickpt.engine.runtime.exit_hook import run_before_thread_pools_shut_down

    def at_exit():
        with ThreadPoolExecutor(1) as pool:  # refused once concurrent.futures shut down
            value = pool.submit(lambda: "pool still accepting work").result()
        with open(sys.argv[1], "w") as f:
            f.write(value)

    assert run_before_thread_pools_shut_down(at_exit), "the early exit hook is not available"
""")


def test_exit_hook_runs_before_thread_pools_shut_down(tmp_path):
    """Guards the one private interpreter API unickpt relies on (``threading._register_atexit``):
    fails loudly when a Python version changes it."""
    out = tmp_path / "hook.txt"
    proc = subprocess.run([sys.executable, "-c", _HOOK, str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "pool still accepting work"
