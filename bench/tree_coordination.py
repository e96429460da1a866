"""Flat vs tree coordination on real gloo ranks of this machine, and the commit barrier vs the
collective commit step it replaced.

Each world size (``--ranks``) runs in fresh processes with two Checkpointers: one whose
collectives are flat, one whose collectives run as a tree (``--ranks-per-host`` simulated hosts,
``--fan-out`` leaders per group). Per round, interleaved, every operation is timed as a
collective (barrier, run, barrier on the world group, rank 0's wall time; "(barriers only)" is
that frame around nothing):

- plan exchange: what ``plan_stage`` does when the plan changed: a gather of every rank's encoded
  local plan (``--plan-bytes`` each; bench/scale.py gives ~24 KB for an FSDP 70B-like layout) at
  rank 0, then a scatter of each rank's part of the global plan (``--part-bytes``);
- run_stage: the error agreement of every stage (one all_gather of a small outcome);
- commit step: every rank's payload (``--payload-bytes``) to rank 0 and the outcome back: the
  collective form (run_stage + gather + run_stage, on the flat groups, as before) vs
  ``coordination.barrier.commit_barrier`` (through the job's store).

On one machine every "host" shares the same cores and loopback, so this measures overheads of
the tree's extra hops, not what it saves at thousands of ranks (rank 0 exchanging with
``fan_out`` peers instead of all). Medians of ``--rounds``.

    python bench/tree_coordination.py [--ranks 8,16] [--ranks-per-host 4] [--fan-out 2] [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_line, median, spawn, table, timed


def _rank(rank: int, ws: int, args: dict[str, Any]) -> dict[str, list[float]]:
    import unickpt
    from unickpt.coordination.barrier import commit_barrier
    from unickpt.coordination.base import run_stage
    from unickpt.coordination.outcomes import Outcome

    tree = unickpt.Checkpointer(
        coordination=unickpt.CoordinationOptions(
            tree_min_world_size=2, fan_out=args["fan_out"], ranks_per_host=args["ranks_per_host"]
        )
    )
    flat = unickpt.Checkpointer(coordination=unickpt.CoordinationOptions(tree_min_world_size=ws + 1))
    coords = {
        name: (c.resources.coordinator("foreground", None, name), c.resources.coordinator("background", None, name))
        for name, c in (("flat", flat), ("tree", tree))
    }
    plan = os.urandom(args["plan_bytes"])
    part = os.urandom(args["part_bytes"])
    payload = os.urandom(args["payload_bytes"])
    times: dict[str, list[float]] = {}
    rounds = args["rounds"]

    def plan_exchange(c: Any) -> None:
        got = c.gather_object(plan)
        parts = [part] * ws if got is not None else None
        c.scatter_object(parts)

    def commit_collective(c: Any) -> None:
        mine = run_stage(c, "save (write)", lambda: payload)
        gathered = c.gather_object(mine)
        run_stage(c, "save (commit)", lambda: len(gathered or []) if c.rank == 0 else None)

    key = [0]

    def commit_store(c: Any) -> None:
        key[0] += 1
        commit_barrier(c, f"bench-{key[0]}", lambda: payload, len, stage="save (write)", commit_stage="save (commit)")

    ops = [
        ("(barriers only)", "-", lambda: None),
        ("plan exchange", "flat", lambda: plan_exchange(coords["flat"][0])),
        ("plan exchange", "tree", lambda: plan_exchange(coords["tree"][0])),
        ("run_stage", "flat", lambda: run_stage(coords["flat"][0], "bench", Outcome)),
        ("run_stage", "tree", lambda: run_stage(coords["tree"][0], "bench", Outcome)),
        ("commit step", "collectives (before)", lambda: commit_collective(coords["flat"][1])),
        ("commit step", "store barrier", lambda: commit_store(coords["flat"][1])),
    ]
    for r in range(rounds + 2):  # two warm-up rounds
        for what, how, fn in ops:
            t, _ = timed(fn)
            if r >= 2:
                times.setdefault(f"{what}|{how}", []).append(t)
    tree.close()
    flat.close()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="8,16")
    p.add_argument("--ranks-per-host", type=int, default=4)
    p.add_argument("--fan-out", type=int, default=2)
    p.add_argument("--plan-bytes", type=int, default=24_000)
    p.add_argument("--part-bytes", type=int, default=10_000)
    p.add_argument("--payload-bytes", type=int, default=2_000)
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args()
    args = {
        "ranks_per_host": a.ranks_per_host,
        "fan_out": a.fan_out,
        "plan_bytes": a.plan_bytes,
        "part_bytes": a.part_bytes,
        "payload_bytes": a.payload_bytes,
        "rounds": a.rounds,
    }
    print(machine_line())
    rows = []
    for ws in [int(x) for x in a.ranks.split(",")]:
        t0 = time.perf_counter()
        res = spawn(_rank, ws, args, timeout=1800, threads=1)
        took = time.perf_counter() - t0
        for name in res[0]:
            what, how = name.split("|")
            ms = median(res[0][name]) * 1e3
            rows.append((ws, what, how, f"{ms:.2f}"))
        print(f"world size {ws}: {took:.0f}s including process start", flush=True)
    print(
        table(
            f"medians of {a.rounds} rounds, rank 0's wall time per operation (barrier, op, barrier), "
            f"tree: {a.ranks_per_host} ranks per host, fan-out {a.fan_out}",
            ["ranks", "operation", "coordination", "ms"],
            rows,
            left=(1, 2),
        )
    )


if __name__ == "__main__":
    main()
