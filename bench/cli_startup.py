"""How long ``import unickpt`` and the ``unickpt`` command line take to start (issue #30 item 5).

    python bench/cli_startup.py                                  # this tree
    python bench/cli_startup.py --baseline-src /work/main/src    # before (another tree) vs this one

Every figure is a fresh interpreter (``python -c "import unickpt"``, ``python -m unickpt ...``,
with ``PYTHONPATH`` at the tree's ``src``), run ``--runs`` times, the trees interleaved run by
run; printed: the median wall time and the median CPU time (user + system of the child, less
noisy on a shared machine), and for two trees the ratio before / after. The commands are the
metadata-only ones (``--help``, ``ls``, ``latest``, ``prune --dry-run``, ``inspect``) on a small
``CheckpointManager`` root this script saves first (or ``--root``), and ``import torch`` as the
floor torch alone costs. Last, ``python -X importtime -c "import unickpt"``: the import time of
each top-level package (self time summed), the top offenders first, per tree.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent

# saves steps 1-3 (a small model and its AdamW state) under argv[1] with the tree's unickpt
_MAKE_ROOT = """
import sys, torch, unickpt
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8)))
opt = torch.optim.AdamW(model.parameters())
manager = unickpt.CheckpointManager(sys.argv[1], keep_last=None)
for step in (1, 2, 3):
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    manager.save(step, {"model": model, "optimizer": opt, "extra_state": {"step": step}})
manager.wait()
print(manager.path_for(3))
"""


def _env(src: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(src), PYTHONWARNINGS="ignore")


def _run(argv: list[str], src: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of one run; fails loudly on a nonzero exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, env=_env(src), cwd=tempfile.gettempdir(), capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} (PYTHONPATH={src}) failed:\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _import_times(python: str, src: Path) -> list[tuple[str, float]]:
    """Self import time (seconds) per top-level package of ``import unickpt``, largest first."""
    proc = subprocess.run(
        [python, "-X", "importtime", "-c", "import unickpt"],
        env=_env(src),
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        check=True,
    )
    per: dict[str, float] = defaultdict(float)
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _, name = (part.strip() for part in line[len("import time:") :].split("|"))
        per[name.split(".")[0]] += int(self_us) / 1e6
    return sorted(per.items(), key=lambda kv: -kv[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, default=HERE.parent / "src", help="the tree measured (its src folder)")
    parser.add_argument("--baseline-src", type=Path, default=None, help="the tree to compare with (before)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each command per tree (5)")
    parser.add_argument("--root", type=Path, default=None, help="a CheckpointManager root (default: made here)")
    parser.add_argument("--top", type=int, default=8, help="packages listed from -X importtime (8)")
    args = parser.parse_args()
    python = sys.executable
    trees = {"after": args.src.resolve()}
    if args.baseline_src is not None:
        trees = {"before": args.baseline_src.resolve(), **trees}

    with tempfile.TemporaryDirectory(prefix="unickpt-cli-bench-") as tmp:
        root = args.root
        if root is None:
            root = Path(tmp) / "root"
            subprocess.run([python, "-c", _MAKE_ROOT, str(root)], env=_env(trees["after"]), check=True)
        step = sorted(p for p in root.iterdir() if p.name.startswith("step_"))[-1]
        commands = {
            "import torch (floor)": [python, "-c", "import torch"],
            "import unickpt": [python, "-c", "import unickpt"],
            "unickpt --help": [python, "-m", "unickpt", "--help"],
            "unickpt ls ROOT": [python, "-m", "unickpt", "ls", str(root)],
            "unickpt latest ROOT": [python, "-m", "unickpt", "latest", str(root)],
            "unickpt prune --dry-run": [python, "-m", "unickpt", "prune", str(root), "--keep-last", "1", "--dry-run"],
            "unickpt inspect STEP": [python, "-m", "unickpt", "inspect", str(step)],
        }
        times: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
        for _ in range(args.runs):
            for name, argv in commands.items():
                for tree, src in trees.items():  # interleaved: before, after, before, after ...
                    times[name, tree].append(_run(argv, src))

    print(
        f"# unickpt start-up, {args.runs} runs each, medians (python {sys.version.split()[0]}, {os.cpu_count()} CPUs)"
    )
    for tree, src in trees.items():
        print(f"#   {tree}: {src}")
    header = f"{'command':<26}" + "".join(f"{t + ' wall':>13}{t + ' cpu':>12}" for t in trees)
    if len(trees) == 2:
        header += f"{'ratio wall':>12}{'ratio cpu':>11}"
    print(header)
    for name in commands:
        row = f"{name:<26}"
        med = {}
        for tree in trees:
            wall = statistics.median(w for w, _ in times[name, tree])
            cpu = statistics.median(c for _, c in times[name, tree])
            med[tree] = (wall, cpu)
            row += f"{wall:>12.3f}s{cpu:>11.3f}s"
        if len(trees) == 2:
            (bw, bc), (aw, ac) = med["before"], med["after"]
            row += f"{bw / aw:>11.1f}x{bc / ac:>10.1f}x"
        print(row)
    for tree, src in trees.items():
        top = _import_times(python, src)[: args.top]
        print(f"# -X importtime, import unickpt ({tree}): " + ", ".join(f"{n} {s:.3f}s" for n, s in top))


if __name__ == "__main__":
    main()
