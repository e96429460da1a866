"""Peak memory of ``unickpt merge``: bounded by its piece size (``--piece-size``, default 64 MiB),
not by the largest tensor nor the checkpoint.

    python bench/merge_memory.py --tensors 8 --mib-each 128
    python bench/merge_memory.py --tensors 1 --mib-each 1024 --piece-size 64MiB

Saves ``--tensors`` fp32 tensors of ``--mib-each`` MiB with unickpt, then runs ``unickpt merge``
(safetensors) in a fresh process and reads that process's peak resident set size
(``ru_maxrss`` of that child alone, from ``os.wait4``); a child that only imports unickpt and
torch gives the baseline. This process stays small (no torch here: a forked child's
``ru_maxrss`` starts at its parent's size), and the checkpoint is written by a child too.
Prints peak - baseline against the piece size, the largest tensor and the checkpoint size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

MiB = 1 << 20


def child_peak(cmd: list[str]) -> int:
    """Peak RSS in bytes of the child running ``cmd`` (its own rusage, from ``os.wait4``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed with {proc.returncode}")
    return usage.ru_maxrss * 1024  # kB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--mib-each", type=int, default=128)
    ap.add_argument("--piece-size", default="64MiB", help="merge's --piece-size (64MiB)")
    args = ap.parse_args()
    n = args.mib_each * MiB // 4
    with tempfile.TemporaryDirectory(prefix="unickpt-merge-mem-") as tmp:
        save = (
            "import sys, torch, unickpt\n"
            "n, k, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]\n"
            "m = torch.nn.ParameterDict({f't{i}': torch.nn.Parameter(torch.randn(n)) for i in range(k)})\n"
            "unickpt.save(path, {'model': m})\n"
        )
        subprocess.run([sys.executable, "-c", save, str(n), str(args.tensors), os.path.join(tmp, "ck")], check=True)
        base = child_peak([sys.executable, "-c", "import torch, unickpt.cli, unickpt.ops.merge"])
        peak = child_peak(
            [
                sys.executable,
                "-m",
                "unickpt.cli",
                "merge",
                os.path.join(tmp, "ck"),
                os.path.join(tmp, "out"),
                "--piece-size",
                args.piece_size,
            ]
        )
        total = args.tensors * args.mib_each * MiB
        extra = peak - base
        print(f"checkpoint {total / MiB:.0f} MiB in {args.tensors} tensors of {args.mib_each} MiB")
        print(f"merge peak RSS {peak / MiB:.0f} MiB, import-only baseline {base / MiB:.0f} MiB")
        print(
            f"extra {extra / MiB:.0f} MiB (piece size {args.piece_size}) = "
            f"{extra / (args.mib_each * MiB):.2f}x the largest tensor, {extra / total:.2f}x the checkpoint"
        )


if __name__ == "__main__":
    main()
