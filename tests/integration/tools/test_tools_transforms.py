"""Load-time tensor transforms (issue 15: the key-mapping hook's "transform" half): a fused QKV
projection saved by FSDP2 on 2 ranks loads into separate Q, K, V on 3 ranks (shards straddle
the Q|K|V boundaries) and on 1 process, model and AdamW state bit-exact; a damaged byte in the
part of a straddling shard that no derived tensor uses is still caught.

Expected values: slices of the saved full state computed with plain torch here."""

from __future__ import annotations

import os

import pytest
import torch

import unickpt
from tests.workers.harness import run_ranks
from tests.workers.transform_workers import H, QOnly, built, load_split, qkv_transforms, save_fused
from unickpt.format import METADATA_FILE, decode_metadata
from unickpt.options import RestoreOptions


def _expected(saved: dict) -> dict:
    """The split model's full state, sliced from the fused one with torch."""
    want = {}
    for key, value in saved.items():
        t = torch.tensor(value)
        for name in ("weight", "bias"):
            head = f"qkv.{name}"
            if key.endswith(head) or f".{head}." in key:
                for i, n in enumerate("qkv"):
                    part = t if t.dim() == 0 else t[i * H : (i + 1) * H]
                    want[key.replace(head, f"{n}.{name}")] = part
                break
        else:
            want[key] = t
    return want


@pytest.fixture(scope="module")
def fused_ckpt(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("fused") / "ck")
    saved = run_ranks(save_fused, 2, ckpt)[0]
    return ckpt, _expected(saved)


@pytest.mark.parametrize("ws", [1, 3])
def test_issue15_fused_qkv_loads_into_separate_q_k_v(fused_ckpt, ws):
    ckpt, want = fused_ckpt
    results = run_ranks(load_split, ws, ckpt) if ws > 1 else [load_split(0, 1, ckpt)]
    for rank, r in enumerate(results):
        got = {k: torch.tensor(v) for k, v in r["state"].items()}
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        bad = [k for k in want if not torch.equal(got[k], want[k].to(got[k].dtype))]
        assert not bad, f"rank {rank}: {bad}"
        assert r["groups"][0]["lr"] == 1e-2 and r["groups"][0]["weight_decay"] == 0.05


def test_issue15_damage_outside_the_used_part_of_a_straddling_shard_is_caught(fused_ckpt, tmp_path):
    """Rank 0 of the save holds qkv.weight rows [0, 18): rows 12-17 belong to K. Damage row 15
    and load a model that has only Q: the checksum chunk holding rows 0-17 is read and verified
    whole, so the load fails although no loaded tensor uses the damaged byte."""
    import shutil

    ckpt, _ = fused_ckpt
    copy = str(tmp_path / "ck")
    shutil.copytree(ckpt, copy)
    md = decode_metadata(open(os.path.join(copy, METADATA_FILE), "rb").read())
    shard = next(s for s in md.tensors["model.qkv.weight"].shards if s.offsets == (0, 0))
    assert shard.lengths == (18, 8), shard  # split rows of a layout or a row of its own: same bytes
    file, offset = md.files[shard.file_index], shard.byte_offset
    with open(os.path.join(copy, file), "r+b") as f:
        f.seek(offset + 15 * 8 * 4)
        b = f.read(1)
        f.seek(offset + 15 * 8 * 4)
        f.write(bytes([b[0] ^ 1]))
    options = unickpt.LoadOptions(restore=RestoreOptions(transforms=qkv_transforms("q")))
    model, optim = built(QOnly, 2)
    unickpt.load(ckpt, {"model": model, "optimizer": optim}, options=options)  # the intact one loads
    model, optim = built(QOnly, 2)
    with pytest.raises(unickpt.ChecksumMismatchError) as e:
        unickpt.load(copy, {"model": model, "optimizer": optim}, options=options)
    assert "'model.q.weight'" in str(e.value) and "checksum mismatch" in str(e.value), e.value
