"""CPU time of the save planner alone (``plan_save`` on the gathered, encoded local plans, as the
coordinator runs it in ``engine.plan_cache``), for A/B runs of two source trees.

Jobs (synthetic shard specs, no tensors, no processes):
- ``many_small``: bench/many_small.py's state at world size 2 (6,700 params of 48 x 50 fp32,
  each ``Shard(0)``: every rank one ``torch.chunk`` part, plus AdamW's exp_avg, exp_avg_sq and a
  replicated 0-d step: ~27,000 specs per rank; one rank group);
- ``many_small_irregular``: the same tensors split unevenly (rank 0: 20 rows, rank 1: 28) with
  the steps replicated (one group per rank);
- ``irregular1024`` (not in the default list): 1,024 ranks, each an uneven block (rank r:
  8 + r % 5 rows) of 200 tensors of 16 columns plus a replicated 0-d step each: one group per
  rank, more than the 64 templates the planner once had;
- ``fsdp4096``: bench/scale.py's Llama-70B FSDP layout at 4,096 ranks (``scale.fsdp_local``),
  the figure of ``scale.py --ranks 4096``'s global plan, without the rest of that bench.
The encoded local plans are built once per job and cached under ``--cache`` (length-prefixed
bytes; building the 4,096 ranks takes minutes), then ``plan_save`` is timed ``--repeat``
times with ``time.process_time`` (CPU seconds of this process). One line of JSON per job.

    PYTHONPATH=src python bench/plan_save_cpu.py --jobs many_small,fsdp4096 [--repeat 1] [--digest]

For an A/B, run it alternately with ``PYTHONPATH`` naming each tree's ``src``, several times.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from unickpt.planning.save.model import LocalSavePlan
from unickpt.planning.save.plan import plan_save
from unickpt.planning.save.wire import LocalPlans, encode_local_plan, encode_rank_rows
from unickpt.planning.specs import ShardSpec

SAVE_ID = "20250101T000000-0123456789ab"


def _many_small(rank: int, world: int, irregular: bool, params: int = 6700, rows: int = 48) -> LocalSavePlan:
    cut = 20 if irregular else -(-rows // world)
    lo, n = (0, cut) if rank == 0 else (cut, rows - cut)
    specs = []
    for i in range(params):
        g, p = divmod(i, 100)
        name = f"layers.{g}.p{p}.weight"
        box = ((lo, 0), (n, 50))
        specs.append(ShardSpec(f"model.{name}", "float32", (rows, 50), *box))
        for state in ("exp_avg", "exp_avg_sq"):
            specs.append(ShardSpec(f"optimizer.state.{name}.{state}", "float32", (rows, 50), *box))
        specs.append(ShardSpec(f"optimizer.state.{name}.step", "float32", (), (), ()))
    return LocalSavePlan(rank, tuple(specs))


def _irregular(rank: int, world: int, tensors: int = 200) -> LocalSavePlan:
    cuts = [0]
    for r in range(world):
        cuts.append(cuts[-1] + 8 + r % 5)
    box = ((cuts[rank], 0), (cuts[rank + 1] - cuts[rank], 16))
    specs = []
    for i in range(tensors):
        specs.append(ShardSpec(f"model.w{i}", "float32", (cuts[-1], 16), *box))
        specs.append(ShardSpec(f"optimizer.state.w{i}.step", "float32", (), (), ()))
    return LocalSavePlan(rank, tuple(specs))


def _encoded(job: str, cache: str) -> list[bytes]:
    path = os.path.join(cache, f"plan_save_cpu-{job}.bin")
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
        out, at = [], 0
        while at < len(data):
            (n,) = struct.unpack_from("<Q", data, at)
            out.append(data[at + 8 : at + 8 + n])
            at += 8 + n
        return out
    if job == "fsdp4096":
        from scale import fsdp_local

        encoded = [encode_local_plan(fsdp_local(r, 4096)) for r in range(4096)]
    elif job == "irregular1024":
        encoded = [encode_local_plan(_irregular(r, 1024)) for r in range(1024)]
    else:
        encoded = [encode_local_plan(_many_small(r, 2, job == "many_small_irregular")) for r in range(2)]
    os.makedirs(cache, exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        for b in encoded:
            f.write(struct.pack("<Q", len(b)) + b)
    os.replace(path + ".tmp", path)
    return encoded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default="many_small,many_small_irregular,fsdp4096")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--cache", default="/tmp/unickpt-bench-cache")
    ap.add_argument("--digest", action="store_true", help="also a SHA-256 of the plan (every rank's encoded part)")
    args = ap.parse_args()
    import unickpt

    for job in args.jobs.split(","):
        encoded = _encoded(job, args.cache)
        times = []
        for _ in range(args.repeat):
            t = time.process_time()
            gplan = plan_save(LocalPlans(encoded), SAVE_ID, 2)
            times.append(time.process_time() - t)
        out = {"job": job, "src": os.path.dirname(unickpt.__file__), "cpu_s": times}
        out["rank_plans"] = type(gplan.rank_plans).__name__
        if args.digest:  # equal digests: the same plan (files, writers, layouts, every rank's entries)
            h = hashlib.sha256(repr((gplan.files, gplan.writers, gplan.layouts, list(gplan.tensors.items()))).encode())
            for r in range(len(encoded)):
                h.update(encode_rank_rows(r, gplan.save_id, *gplan.rank_rows(r)))
            out["digest"] = h.hexdigest()[:16]
        print(json.dumps(out))


if __name__ == "__main__":
    main()
