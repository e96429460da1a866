"""The Hugging Face export inside the save (issue 30 item 4), ws=2 gloo ranks, one spawn
(``hf_export_workers.export_ws2``): every rank writes its share of the safetensors files; the
files equal, byte for byte, the offline ``unickpt merge`` of the same checkpoint (FSDP2 with a
bf16 cast and a config; tensor parallelism with dim-1 boxes and a rename); the tensors equal the
ranks' own ``full_tensor()``; the index names every tensor; ``transformers`` loads the folder;
a folder that is not empty is refused on every rank."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file

from tests.support.safetensors_folder import read_safetensors_folder
from tests.workers.harness import run_ranks
from tests.workers.hf_export_workers import export_ws2

HF_MANIFEST = "unickpt.hf_export.json"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("hfx"))
    return root, run_ranks(export_ws2, 2, root, timeout=300)


def _read_folder(folder: str) -> dict[str, bytes]:
    """The folder's files, without the record of what the in-save export wrote (its manifest)."""
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder)) if n != HF_MANIFEST}


def _manifest_names_every_file_with_its_size(folder: str) -> None:
    doc = json.load(open(os.path.join(folder, HF_MANIFEST)))
    assert doc["format"] == "unickpt.hf_export" and doc["version"] == 1 and doc["complete"] is True
    assert {name: size for name, size in doc["files"]} == {
        n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n != HF_MANIFEST
    }


def _check_index(folder: str, tensors: dict[str, torch.Tensor]) -> None:
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    assert sorted(index["weight_map"]) == sorted(tensors)
    for name, fname in index["weight_map"].items():
        assert name in load_file(os.path.join(folder, fname))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_fsdp2_bf16_export_equals_offline_merge_and_loads_in_transformers(exported) -> None:
    root, outs = exported
    hf = os.path.join(root, "llama", "huggingface")
    got = _read_folder(hf)
    assert len([n for n in got if n.endswith(".safetensors")]) > 2  # several shard files
    assert "config.json" in got and "model.safetensors.index.json" in got
    assert got == _read_folder(os.path.join(root, "llama_merged"))  # byte for byte
    _manifest_names_every_file_with_its_size(hf)
    want = outs[0]["llama"]
    tensors = read_safetensors_folder(hf)
    assert sorted(tensors) == sorted(want)
    for k, v in want.items():
        assert tensors[k].dtype == torch.bfloat16 and torch.equal(tensors[k], v), k
    _check_index(hf, tensors)

    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.bfloat16)
    loaded = model.state_dict()
    for k, v in want.items():
        assert torch.equal(loaded[k], v), k


def test_tensor_parallel_strided_boxes_and_rename_equal_offline_merge(exported) -> None:
    root, outs = exported
    assert outs[0]["placements"]["down.weight"] == ["Shard"] and outs[0]["placements"]["down.bias"] == ["Replicate"]
    hf = os.path.join(root, "mlp", "huggingface")
    got = _read_folder(hf)
    assert len([n for n in got if n.endswith(".safetensors")]) > 1
    assert got == _read_folder(os.path.join(root, "mlp_merged"))  # byte for byte
    _manifest_names_every_file_with_its_size(hf)
    want = {f"mlp.{k}": v for k, v in outs[0]["mlp"].items() if k != "up.bias"}
    tensors = read_safetensors_folder(hf)
    assert sorted(tensors) == sorted(want)
    for k, v in want.items():
        assert tensors[k].dtype == torch.float32 and torch.equal(tensors[k], v), k
    _check_index(hf, tensors)


def test_export_into_a_folder_that_is_not_empty_is_refused_on_every_rank(exported) -> None:
    root, outs = exported
    assert all("is not empty" in o["refused"] for o in outs), [o["refused"] for o in outs]
    assert sorted(os.listdir(os.path.join(root, "busy"))) == ["mine.txt"]
