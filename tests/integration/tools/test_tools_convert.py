"""``unickpt convert`` (issue 15): PyTorch DCP and ByteCheckpoint-layout checkpoints written by
``torch.distributed.checkpoint`` itself, and Hugging Face folders written by ``transformers``, are
imported and load into live models bit for bit; a unickpt checkpoint exported to DCP is read by
DCP's own loader; a DCP ``.metadata`` that carries a pickle payload is refused before it runs."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import unickpt

CLI = [sys.executable, "-m", "unickpt.cli"]


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 5)).sum().backward()
    optim.step()
    return model, optim


def _dcp_save(state, folder: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)


def test_issue15_convert_from_dcp_loads_model_and_optimizer_state(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _trained(0)
    msd, osd = get_state_dict(model, optim)
    _dcp_save({"model": msd, "optim": osd}, str(tmp_path / "dcp"))
    r = _cli("convert", "--from", "dcp", str(tmp_path / "dcp"), str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr
    assert "param_groups" not in r.stdout  # imported, not skipped
    fresh, fresh_optim = _trained(1)
    for g in fresh_optim.param_groups:
        g["lr"], g["betas"] = 0.5, (0.1, 0.2)  # the checkpoint's hyper-parameters must come back
    unickpt.load(str(tmp_path / "ck"), {"model": fresh, "optimizer": fresh_optim})  # strict: every key
    assert fresh_optim.state_dict()["param_groups"] == optim.state_dict()["param_groups"]
    for p, q in zip(model.parameters(), fresh.parameters()):
        for name, t in optim.state[p].items():
            assert torch.equal(fresh_optim.state[q][name], t), name
    fresh, _ = _trained(1)
    unickpt.load(str(tmp_path / "ck"), {"model": fresh}, strict=False)
    for (k, v), (_, w) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(v, w), k
    flat = unickpt.FlatTensors(
        {f"optimizer.state.{n}.{s}": torch.empty_like(t) for n, st in osd["state"].items() for s, t in st.items()}
    )
    unickpt.load(str(tmp_path / "ck"), {"model": flat}, strict=False)
    for n, st in osd["state"].items():
        for s, t in st.items():
            assert torch.equal(flat[f"optimizer.state.{n}.{s}"], t), (n, s)


def test_issue15_convert_bytecheckpoint_layout(tmp_path):
    model, _ = _trained(2)
    root = tmp_path / "bcp"
    _dcp_save({k: v.clone() for k, v in model.state_dict().items()}, str(root / "model"))
    os.makedirs(root / "extra_state")
    r = _cli("convert", "--from", "dcp", str(root), str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr
    fresh, _ = _trained(3)
    unickpt.load(str(tmp_path / "ck"), {"model": fresh})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch BOOM_RAN",))


def test_issue15_malicious_dcp_metadata_is_refused_before_it_runs(tmp_path):
    model, _ = _trained(4)
    folder = tmp_path / "dcp"
    _dcp_save({k: v.clone() for k, v in model.state_dict().items()}, str(folder))
    (folder / ".metadata").write_bytes(pickle.dumps(_Boom()))
    r = _cli("convert", "--from", "dcp", str(folder), str(tmp_path / "ck"), cwd=tmp_path)
    assert r.returncode == 1 and "CorruptMetadataError" in r.stderr and "posix.system" in r.stderr, r.stderr
    assert not (tmp_path / "BOOM_RAN").exists()
    assert not (tmp_path / "ck").exists()


def test_issue15_export_to_dcp_is_read_by_dcp(tmp_path):
    model, optim = _trained(5)
    unickpt.save(str(tmp_path / "ck"), {"model": model, "optimizer": optim})
    r = _cli("convert", "--to", "dcp", str(tmp_path / "ck"), str(tmp_path / "dcp"))
    assert r.returncode == 0, r.stderr
    want = {f"model.{k}": v for k, v in model.state_dict().items()}
    for p_name, p in model.named_parameters():
        for s, t in optim.state[p].items():
            want[f"optimizer.state.{p_name}.{s}"] = t
    got = {k: torch.empty_like(v) for k, v in want.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")), no_dist=True)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_issue15_convert_from_hf_starts_a_run(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    src = transformers.LlamaForCausalLM(config)
    src.save_pretrained(str(tmp_path / "hf"))
    r = _cli("convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr
    torch.manual_seed(1)
    dst = transformers.LlamaForCausalLM(config)
    unickpt.load(str(tmp_path / "ck"), {"model": dst}, strict=False)  # tied lm_head may be absent from the file
    want = src.state_dict()
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in want.items())


def test_issue15_malicious_dcp_value_is_refused_not_unpickled(tmp_path):
    """A non-tensor entry of a DCP checkpoint (DCP stores them with torch.save) holding a pickle
    that runs code: convert rebuilds plain values only (torch.load(weights_only=True)), so it is
    refused and nothing runs; DCP's own loader would have run it."""
    model, _ = _trained(4)
    folder = tmp_path / "dcp"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["optim.param_groups.0.lr"] = _Boom()
    _dcp_save(state, str(folder))
    r = _cli("convert", "--from", "dcp", str(folder), str(tmp_path / "ck"), cwd=tmp_path)
    assert r.returncode == 1 and "CorruptMetadataError" in r.stderr and "not plain values" in r.stderr, r.stderr
    assert not (tmp_path / "BOOM_RAN").exists()
