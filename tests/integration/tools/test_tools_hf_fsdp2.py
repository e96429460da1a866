"""Hugging Face round trips with FSDP2 (issue 15 must-hold): an FSDP2 ws=4 checkpoint of a tiny
Llama merged to a HF folder loads with ``from_pretrained`` and gives identical logits; a HF folder
converted to unickpt loads into FSDP2 at ws=2 with identical logits. Reference logits come from
the unsharded model built with the same seed (plain transformers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.workers.harness import run_ranks
from tests.workers.hf_workers import llama, llama_config, load_fsdp2_logits, logits, plain_logits, save_fsdp2

CLI = [sys.executable, "-m", "unickpt.cli"]


def test_issue15_fsdp2_ws4_llama_merged_to_hf_gives_identical_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    ck = str(tmp_path / "ck")
    run_ranks(save_fsdp2, 4, ck, 7)
    llama_config().to_json_file(str(tmp_path / "config.json"))
    r = subprocess.run(
        [*CLI, "merge", ck, str(tmp_path / "hf"), "--hf-config", str(tmp_path / "config.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    loaded.eval()
    assert logits(loaded) == logits(llama(7))


def test_issue15_hf_folder_converted_loads_into_fsdp2_ws2_with_identical_logits(tmp_path):
    pytest.importorskip("transformers")
    src = llama(11)
    src.save_pretrained(str(tmp_path / "hf"))
    r = subprocess.run(
        [*CLI, "convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = run_ranks(load_fsdp2_logits, 2, str(tmp_path / "ck"), 12)
    want = run_ranks(plain_logits, 1, 11)[0]  # one thread per process, as the ranks
    assert got[0] == want and got[1] == want


def test_issue15_bytecheckpoint_folder_converts_and_loads_into_fsdp2_bit_exact(tmp_path):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    pytest.importorskip("transformers")
    model = llama(21)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 64, (1, 5))).logits.sum().backward()
    optim.step()
    root = tmp_path / "bcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(model.state_dict(), storage_writer=dcp.FileSystemWriter(str(root / "model")), no_dist=True)
        names = {id(p): n for n, p in model.named_parameters()}
        osd = {f"state.{names[id(p)]}.{k}": v for p, st in optim.state.items() for k, v in st.items()}
        dcp.save(osd, storage_writer=dcp.FileSystemWriter(str(root / "optimizer")), no_dist=True)
    (root / "extra_state").mkdir()
    cmd = [*CLI, "convert", "--from", "dcp", str(root), str(tmp_path / "ck")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    ref = str(tmp_path / "ref.pt")  # the stepped weights, as torch holds them (the ranks compare)
    torch.save({f"model.{k}": v for k, v in model.state_dict().items()}, ref)
    assert run_ranks(_load_stepped, 2, str(tmp_path / "ck"), ref) == [True, True]


def _load_stepped(rank: int, ws: int, path: str, ref: str) -> bool:
    import torch

    import unickpt
    from tests.support.reference import full_state
    from tests.workers.hf_workers import _fsdp2

    want = torch.load(ref, weights_only=True)
    model = _fsdp2(llama(22))
    unickpt.load(path, {"model": model}, framework="fsdp2", strict=False)
    got = full_state(model)
    return set(want) <= set(got) and all(torch.equal(got[k], want[k]) for k in want)
