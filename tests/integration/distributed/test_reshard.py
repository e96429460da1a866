"""Load-time resharding between frameworks and world sizes: bit-exact state, same next loss."""

from __future__ import annotations

import os

import pytest

from tests.workers.harness import SaveLoadMatrix, run_ranks
from tests.workers.reshard_workers import check, load_many, save_many


def _single(fn, *args):
    import torch.distributed as dist

    assert not dist.is_initialized()
    return [fn(0, 1, *args)]


def _run(fn, ws, *args):
    return _single(fn, *args) if ws == 1 else run_ranks(fn, ws, *args)


CASES = [
    ("fsdp2", 4, "fsdp2", 2),
    ("fsdp2", 4, "fsdp2", 3),
    ("fsdp2", 4, "torch", 1),
    ("fsdp2", 2, "fsdp2", 4),
    ("ddp", 2, "fsdp2", 4),
    ("dtensor", 2, "fsdp2", 2),
    ("fsdp2+tp", 4, "ddp", 2),
]


@pytest.fixture(scope="module")
def reshard_runs(tmp_path_factory):
    """Checkpoints saved once per (framework, world size) and the loads of CASES, one spawned job
    per world size doing that size's saves and the loads whose checkpoint an earlier job saved
    (ws 4 saves and loads in one job; ws 1 runs in this process). Returns ``({(framework, ws):
    (ckpt, ref)}, {case: per-rank load results})``."""
    base = str(tmp_path_factory.mktemp("ckpt"))
    m = SaveLoadMatrix(save_many, load_many, CASES, base, extra_sources=[("ddp", 2)], run=_run).run_all()
    return m.saved, m.loaded


@pytest.mark.parametrize("src,src_ws,dst,dst_ws", CASES)
def test_reshard_bit_exact(reshard_runs, src, src_ws, dst, dst_ws):
    saved, loads = reshard_runs
    _, ref = saved[(src, src_ws)]
    check(loads[(src, src_ws, dst, dst_ws)], ref, src_ws)


def test_replicas_written_once_and_balanced(reshard_runs):
    """DDP ws=2: every replicated tensor is stored once, and the bytes are spread over both ranks."""
    from unickpt.format import decode_metadata

    ckpt, _ = reshard_runs[0][("ddp", 2)]
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
