"""Token files for the dataloader tests: every token value is unique across the whole dataset,
so "nothing lost, nothing repeated" is a comparison of sorted lists. Expected values are read
from the .npy files with numpy, never through unickpt."""

from __future__ import annotations

import os

import numpy as np

LENGTHS = {"code": [700, 1, 523], "web": [1200, 389]}
PAD = -1


def write_dataset(folder: str) -> dict[str, list[str]]:
    os.makedirs(folder, exist_ok=True)
    sources: dict[str, list[str]] = {}
    nxt = 0
    for name, lengths in sorted(LENGTHS.items()):
        for i, n in enumerate(lengths):
            path = os.path.join(folder, f"{name}-{i}.npy")
            np.save(path, np.arange(nxt, nxt + n, dtype=np.int32 if name == "code" else np.int64))
            nxt += n
            sources.setdefault(name, []).append(path)
    return sources


def all_tokens(sources: dict[str, list[str]]) -> list[int]:
    return sorted(int(t) for paths in sources.values() for p in paths for t in np.load(p))


def make_loader(sources, dp_rank: int, dp_size: int, **kw):
    from unickpt.data import TokenPackingLoader

    # even_batches=False: each rank to the end of its own parts, so "every token exactly once" is
    # checkable over the whole dataset (the default, equal batches per rank, drops the remainder)
    args = {
        "seq_len": 37,
        "batch_size": 3,
        "seed": 5,
        "epochs": 1,
        "pad_id": PAD,
        "num_parts": 12,
        "block_tokens": 50,
        "even_batches": False,
    }
    args.update(kw)
    return TokenPackingLoader(sources, {"code": 1.0, "web": 3.0}, dp_rank=dp_rank, dp_size=dp_size, **args)


def drain(loader, limit: int | None = None) -> list[int]:
    out: list[int] = []
    for i, batch in enumerate(loader):
        assert batch.dtype.is_floating_point is False and batch.shape[1] == 37
        out.extend(int(t) for t in batch.reshape(-1) if int(t) != PAD)
        if limit is not None and i + 1 >= limit:
            break
    return out
