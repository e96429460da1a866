"""A DDP ws=4 load reads every saved byte from storage once, not 4 times (dedup_reads=True);
without dedup every rank reads its own copy; auto forwards only when ranks do not share a host's
page cache (so on this one host it reads locally, through that cache).

Reads cover whole checksum chunks (4 KiB here, so that the small model spans many): a rank reads
the chunks holding what it reads, so the bytes read are the data files' bytes (padding and blobs
included), plus, with dedup, at most a chunk at each edge of a reader's segments."""

from __future__ import annotations

import torch

from tests.workers.harness import run_ranks


def _save_then_load(rank: int, ws: int, ckpt: str) -> dict:
    import unickpt
    from tests.support.reference import full_state
    from unickpt.options import LoadOptions, ReadOptions
    from unickpt.testing.toy import build, train_step

    model, optim = build("ddp", seed=0)
    train_step(model, optim, 0)
    unickpt.save(ckpt, {"model": model, "optimizer": optim}, options=unickpt.SaveOptions(checksum_chunk_bytes=4096))
    ref = full_state(model, optim)
    from unickpt.storage.local import LocalStorage

    cached = {"n": 0}
    plain = LocalStorage.read_into_cached

    def counting(self, name, offset, out):
        cached["n"] += len(out)
        plain(self, name, offset, out)

    LocalStorage.read_into_cached = counting  # type: ignore[method-assign]
    read: list[int] = []
    unickpt.default_checkpointer().events.add_listener(
        lambda ev: read.append(ev.nbytes) if ev.phase == "load.read" else None
    )
    out = {}
    for mode in ("True", "False", "None"):
        model2, optim2 = build("ddp", seed=7)
        before, cached_before = len(read), cached["n"]
        dedup = {"True": True, "False": False, "None": None}[mode]
        unickpt.load(
            ckpt, {"model": model2, "optimizer": optim2}, options=LoadOptions(io=ReadOptions(dedup_reads=dedup))
        )
        got = full_state(model2, optim2)
        out[mode] = {
            "read": sum(read[before:]),
            "exact": all(torch.equal(ref[k], got[k]) for k in ref),
            "cached": cached["n"] - cached_before,
        }
    return out


def test_ddp_ws4_load_reads_each_byte_once(tmp_path):
    import os

    from unickpt.format import decode_metadata

    ckpt = str(tmp_path / "c")
    res = run_ranks(_save_then_load, 4, ckpt)
    md = decode_metadata(open(os.path.join(ckpt, "unickpt.metadata.json"), "rb").read())
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in md.files)  # every byte of every data file
    assert size >= md.total_tensor_bytes
    for mode, factor in (("False", 4), ("None", 4)):
        assert all(r[mode]["exact"] for r in res), mode
        assert sum(r[mode]["read"] for r in res) == factor * size, mode
    assert all(r["True"]["exact"] for r in res)
    edges = 2 * 4 * 4096 * len(md.files)  # a chunk at each edge of each rank's segments, at most
    assert size <= sum(r["True"]["read"] for r in res) <= size + edges
    assert all(r["True"]["read"] > 0 for r in res)  # the reading is spread over the ranks
    # auto on one host: the bytes every rank reads go through the shared page cache (the device
    # delivers them once); dedup on/off: each byte has one reader, so reads bypass the cache
    assert all(r["None"]["cached"] == r["None"]["read"] for r in res)
    assert all(r["True"]["cached"] == 0 and r["False"]["cached"] == 0 for r in res)
