"""Load-time resharding between frameworks and world sizes: bit-exact state, same next loss."""

from __future__ import annotations

import os

import pytest

from tests.workers.harness import run_ranks
from tests.workers.reshard_workers import check, load_phase, save_phase


def _single(fn, *args):
    import torch.distributed as dist

    assert not dist.is_initialized()
    return [fn(0, 1, *args)]


def _run(fn, ws, *args):
    return _single(fn, *args) if ws == 1 else run_ranks(fn, ws, *args)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints saved once per (framework, world size), shared by the loads below."""
    cache: dict = {}

    def get(framework: str, ws: int):
        key = (framework, ws)
        if key not in cache:
            ckpt = str(tmp_path_factory.mktemp("ckpt") / f"{framework}-{ws}")
            res = _run(save_phase, ws, framework, ckpt)
            ref = dict(res[0])
            ref["next_loss"] = res[0]["next_loss"]
            cache[key] = (ckpt, ref)
        return cache[key]

    return get


@pytest.mark.parametrize(
    "src,src_ws,dst,dst_ws",
    [
        ("fsdp2", 4, "fsdp2", 2),
        ("fsdp2", 4, "fsdp2", 3),
        ("fsdp2", 4, "torch", 1),
        ("fsdp2", 2, "fsdp2", 4),
        ("ddp", 2, "fsdp2", 4),
        ("dtensor", 2, "fsdp2", 2),
        ("fsdp2+tp", 4, "ddp", 2),
    ],
)
def test_reshard_bit_exact(saved, src, src_ws, dst, dst_ws):
    ckpt, ref = saved(src, src_ws)
    results = _run(load_phase, dst_ws, dst, ckpt, ref)
    check(results, ref, src_ws)


def test_replicas_written_once_and_balanced(saved):
    """DDP ws=2: every replicated tensor is stored once, and the bytes are spread over both ranks."""
    from unickpt.format import decode_metadata

    ckpt, _ = saved("ddp", 2)
    md = decode_metadata(open(os.path.join(ckpt, "unickpt.metadata.json"), "rb").read())
    per_rank = {}
    for t in md.tensors.values():
        assert len(t.shards) == 1, t.fqn
        f = md.files[t.shards[0].file_index]
        rank = int(f.split("/r")[1][:5])
        per_rank[rank] = per_rank.get(rank, 0) + t.shards[0].byte_length
    total = sum(per_rank.values())
    assert set(per_rank) == {0, 1}
    assert max(per_rank.values()) - min(per_rank.values()) <= max(t.shards[0].byte_length for t in md.tensors.values())
    assert total == md.total_tensor_bytes
