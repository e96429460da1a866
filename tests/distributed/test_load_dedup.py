"""A DDP ws=4 load reads every saved byte from storage once, not 4 times."""

from __future__ import annotations

import torch

from harness import run_ranks


def _save_then_load(rank: int, ws: int, ckpt: str, dedup: bool) -> dict:
    import unickpt
    from unickpt.monitoring import add_listener
    from unickpt.options import LoadOptions
    from unickpt.tools.toy import build, full_state, train_step

    model, optim = build("ddp", seed=0)
    train_step(model, optim, 0)
    unickpt.save(ckpt, {"model": model, "optimizer": optim})
    ref = full_state(model, optim)
    read = []
    add_listener(lambda ev: read.append(ev.nbytes) if ev.phase == "load.read" else None)
    model2, optim2 = build("ddp", seed=7)
    unickpt.load(ckpt, {"model": model2, "optimizer": optim2}, options=LoadOptions(dedup_reads=dedup))
    got = full_state(model2, optim2)
    return {"read": sum(read), "exact": all(torch.equal(ref[k], got[k]) for k in ref)}


def test_ddp_ws4_load_reads_each_byte_once(tmp_path):
    import os

    from unickpt.format import decode_metadata

    ckpt = str(tmp_path / "c")
    res = run_ranks(_save_then_load, 4, ckpt, True)
    md = decode_metadata(open(os.path.join(ckpt, "unickpt.metadata.json"), "rb").read())
    assert all(r["exact"] for r in res)
    assert sum(r["read"] for r in res) == md.total_tensor_bytes
    assert all(r["read"] > 0 for r in res)  # the reading is spread over the ranks
    res = run_ranks(_save_then_load, 4, str(tmp_path / "d"), False)
    assert all(r["exact"] for r in res)
    assert sum(r["read"] for r in res) == 4 * md.total_tensor_bytes
