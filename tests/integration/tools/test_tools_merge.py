"""``unickpt verify`` and ``unickpt merge`` (issue 15): consolidation of a checkpoint saved at
world size 3 (the golden FSDP2 checkpoint) into safetensors, sharded with an index, dtype casts,
a Hugging Face folder that ``transformers`` loads, and verify's exit codes on a corrupt copy.

Expected values never come from unickpt: the golden checkpoint's closed formula
(tests/unit/format/test_codec_golden.py), ``safetensors``' own reader, torch's ``state_dict`` and
``transformers``' loader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import unickpt
from tests.fixtures.golden_v1 import GOLDEN, expected_fsdp2_ws3

CLI = [sys.executable, "-m", "unickpt.cli"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def _golden(tmp_path) -> str:
    dst = str(tmp_path / "golden")
    shutil.copytree(os.path.join(GOLDEN, "v1_fsdp2_ws3"), dst)
    return dst


def _read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                for k in f.keys():
                    assert k not in out, k
                    out[k] = f.get_tensor(k)
    return out


def test_issue15_merge_ws3_checkpoint_into_one_safetensors_file_bit_exact(tmp_path):
    src = _golden(tmp_path)
    out = tmp_path / "merged"
    r = _cli("merge", src, str(out))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    got = _read_safetensors(str(out))
    want = expected_fsdp2_ws3()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_issue15_merge_model_only_sharded_with_index_and_dtype_cast(tmp_path):
    src = _golden(tmp_path)
    out = tmp_path / "merged"
    r = _cli("merge", src, str(out), "--model-only", "--max-shard-size", "100B", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) >= 2 and all(f.startswith("model-0000") for f in files), files
    assert set(index["weight_map"].values()) == set(files)
    got = _read_safetensors(str(out))
    want = {k[len("model.") :]: v for k, v in expected_fsdp2_ws3().items() if k.startswith("model.")}
    assert set(got) == set(want) == set(index["weight_map"])
    for k, v in want.items():
        expect = v.to(torch.bfloat16) if v.is_floating_point() else v  # integers are never cast
        assert got[k].dtype == expect.dtype and torch.equal(got[k], expect), k
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())


def test_issue15_merge_refuses_a_non_empty_output_folder(tmp_path):
    src = _golden(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    r = _cli("merge", src, str(out))
    assert r.returncode == 1 and "not empty" in r.stderr, r.stderr
    assert os.listdir(out) == ["mine.txt"] and (out / "mine.txt").read_text() == "keep"


def test_issue15_verify_exit_codes_name_each_problem(tmp_path):
    src = _golden(tmp_path)
    ok = _cli("verify", src)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stdout + ok.stderr
    files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(src, "data")) for f in fs)
    with open(files[0], "r+b") as f:  # flip one byte of the first data file
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    os.unlink(files[1])
    bad = _cli("verify", src)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "ChecksumMismatchError" in bad.stdout and "MissingDataFileError" in bad.stdout, bad.stdout
    assert os.path.basename(files[1]) in bad.stdout
    nothing = _cli("verify", str(tmp_path / "nope"))
    assert nothing.returncode == 1


def test_issue15_merge_hf_folder_loads_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    unickpt.save(str(tmp_path / "ck"), {"model": model})
    config_file = tmp_path / "config.json"
    config.to_json_file(str(config_file))
    out = tmp_path / "hf"
    r = _cli("merge", str(tmp_path / "ck"), str(out), "--hf-config", str(config_file))
    assert r.returncode == 0, r.stderr
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out), local_files_only=True)
    got = loaded.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_issue15_verify_catches_truncation_and_a_missing_metadata_file(tmp_path):
    src = _golden(tmp_path)
    files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(src, "data")) for f in fs)
    os.truncate(files[2], os.path.getsize(files[2]) - 3)
    bad = _cli("verify", src)
    assert bad.returncode == 1 and "TruncatedDataFileError" in bad.stdout, bad.stdout
    assert os.path.basename(files[2]) in bad.stdout
    os.unlink(os.path.join(src, "unickpt.metadata.json"))
    gone = _cli("verify", src)
    assert gone.returncode == 1 and "IncompleteCheckpointError" in gone.stderr, gone.stderr
