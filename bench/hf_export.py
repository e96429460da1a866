"""Hugging Face export written by every rank (``unickpt.export_hf``, what
``SaveOptions(hf_export=...)`` runs right after the commit) against the offline ``unickpt
merge`` of the same checkpoint: wall time and peak RSS per rank, same run, interleaved rounds,
medians.

    python bench/hf_export.py                       # ws=4, 0.5 GiB of fp32 weights, bf16 export
    python bench/hf_export.py --gib 1 --rounds 5 --dtype fp32

A FSDP2 stack of ``Linear(dim, dim)`` (fp32, ``--gib`` of weights) is saved once by ``--ws``
gloo ranks. Then, per round, in fresh processes, in alternating order:
  export  ``--ws`` ranks rebuild the model (same seed), warm up (one tiny export creates the
          checkpointer's process groups, as the save before it does), call ``unickpt.export_hf``: the
          call's wall time (slowest rank) and each rank's peak RSS inside the call, above its
          RSS before it (sampled every 5 ms);
  merge   one process runs ``unickpt.ops.merge.merge(model_only=True)`` of the checkpoint
          (warm page cache: the save just wrote it): wall time, peak RSS above its RSS before.
Both write ``--max-shard-mib`` files in ``--dtype``; every round checks that the two folders
hold the same tensors bit for bit (the files themselves are byte-identical when the export runs
inside the save: tests/integration/tools/test_hf_export.py). The machine may be loaded: quote
medians, compare within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import GiB, PeakRSS, barrier, median, rmtree, spawn, table

MiB = 1 << 20


def _model(layers: int, dim: int) -> Any:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def save_ranks(rank: int, ws: int, path: str, layers: int, dim: int) -> None:
    import unickpt

    unickpt.save(path, {"model": _model(layers, dim)})


def export_ranks(rank: int, ws: int, out: str, layers: int, dim: int, dtype: str, shard: int) -> dict[str, float]:
    import torch

    import unickpt

    model = _model(layers, dim)
    opts = unickpt.HFExport(dtype=dtype, max_shard_bytes=shard, always_index=False)
    # warm-up: the checkpointer's process groups are created by its first collective (a save
    # has them already when its export runs)
    unickpt.export_hf(out + "-warm-up", {"model": torch.nn.Linear(2, 2)})
    peak = PeakRSS()
    barrier()
    t0 = time.perf_counter()
    with peak.region("export"):
        unickpt.export_hf(out, {"model": model}, opts)
    barrier()
    seconds = time.perf_counter() - t0
    peak.close()
    before, top, _ = peak.regions["export"][0]
    return {"seconds": seconds, "extra": top - before, "peak": top}


def merge_process(rank: int, ws: int, path: str, out: str, dtype: str, shard: int) -> dict[str, float]:
    import unickpt  # noqa: F401  (imports outside the measured region)
    from unickpt.ops.merge import merge

    peak = PeakRSS()
    t0 = time.perf_counter()
    with peak.region("merge"):
        merge(path, out, model_only=True, dtype=dtype, max_shard_bytes=shard)
    seconds = time.perf_counter() - t0
    peak.close()
    before, top, _ = peak.regions["merge"][0]
    return {"seconds": seconds, "extra": top - before, "peak": top}


def same_tensors(a: str, b: str) -> bool:
    """The two folders hold the same tensors bit for bit (their split into files may differ:
    ``export_hf`` outside a save orders tensors as the ranks list them, merge as the metadata)."""
    import torch
    from safetensors.torch import load_file

    def every(folder: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for n in os.listdir(folder):
            if n.endswith(".safetensors"):
                out.update(load_file(os.path.join(folder, n)))
        return out

    x, y = every(a), every(b)
    return sorted(x) == sorted(y) and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.5, help="fp32 weights (GiB)")
    ap.add_argument("--ws", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--max-shard-mib", type=int, default=128)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    dim = 2048
    layers = max(2, round(args.gib * GiB / (dim * dim * 4)))
    shard = args.max_shard_mib * MiB
    root = tempfile.mkdtemp(prefix="bench-hfx-", dir=args.dir)
    ckpt = os.path.join(root, "ckpt")
    try:
        spawn(save_ranks, args.ws, ckpt, layers, dim)
        rows: dict[str, list[dict[str, float]]] = {"export": [], "merge": []}
        for r in range(args.rounds):
            out_e, out_m = os.path.join(root, f"export{r}"), os.path.join(root, f"merge{r}")
            order = ["export", "merge"] if r % 2 == 0 else ["merge", "export"]
            for which in order:
                if which == "export":
                    res = spawn(export_ranks, args.ws, out_e, layers, dim, args.dtype, shard)
                    rows["export"].append(
                        {
                            "seconds": max(x["seconds"] for x in res),
                            "extra": max(x["extra"] for x in res),
                            "peak": max(x["peak"] for x in res),
                        }
                    )
                else:
                    rows["merge"].append(spawn(merge_process, 0, ckpt, out_m, args.dtype, shard)[0])
            if not same_tensors(out_e, out_m):
                raise SystemExit(f"round {r}: the export and the merge differ")
            for done in (out_e, out_e + "-warm-up", out_m):
                rmtree(done)
            print(
                f"round {r}: export {rows['export'][-1]['seconds']:.2f} s, merge {rows['merge'][-1]['seconds']:.2f} s"
            )
        ex = {k: median([x[k] for x in rows["export"]]) for k in ("seconds", "extra", "peak")}
        mg = {k: median([x[k] for x in rows["merge"]]) for k in ("seconds", "extra", "peak")}
        size = layers * dim * dim * 4
        print(
            table(
                f"HF export of {size / GiB:.2f} GiB fp32 as {args.dtype}, ws={args.ws}, "
                f"medians of {args.rounds} (bit-exact checked)",
                ["", "wall s", "peak RSS above start, MiB", "peak RSS, MiB"],
                [
                    [f"export_hf, {args.ws} ranks (max over ranks)", f"{ex['seconds']:.2f}",
                     f"{ex['extra'] / MiB:.0f}", f"{ex['peak'] / MiB:.0f}"],
                    ["unickpt merge, 1 process", f"{mg['seconds']:.2f}", f"{mg['extra'] / MiB:.0f}",
                     f"{mg['peak'] / MiB:.0f}"],
                    ["ratio merge / export", f"{mg['seconds'] / ex['seconds']:.2f}x", "", ""],
                ],
            )
        )  # fmt: skip
    finally:
        rmtree(root)


if __name__ == "__main__":
    main()
