"""``unickpt.integrations.verl`` with the real verl package (verl_workers.py): saved at ws=2 with
FSDP2 through ``UnickptFSDPCheckpointManager`` as built by verl's engine module after
``install()`` (async, retention, roles, hf_model), resumed bit-exact at ws=2 and compared with
verl's own ``FSDPCheckpointManager`` saving and resuming the same state at the same size; verl's
own checkpoint converted with ``unickpt convert --from verl-fsdp``; both loaded at ws=1 and ws=3,
as is the async save of step 2 (written while step 3 trained); FSDP2 with ``CPUOffloadPolicy``
(verl's ``offload_policy``) saved and resumed at ws=2 and loading at ws=1 and ws=3.
Expected values are the saving ranks' own tensors (``full_tensor``). One spawn per world size.
The hostile-input tests of the converter are single-process."""

from __future__ import annotations

import io
import os
import pickle
import sys
import warnings
import zipfile
from typing import Any

import pytest
import torch

pytest.importorskip("verl.utils.checkpoint.fsdp_checkpoint_manager")


from tests.support.compare import assert_same_tree
from tests.workers.harness import run_ranks
from tests.workers.verl_workers import load_other_ws, save_ws2
from unickpt.errors import CheckpointError, CorruptMetadataError, SizeLimitError, UnsafePathError


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    from unickpt.cli import main

    root = str(tmp_path_factory.mktemp("verl"))
    outs = run_ranks(save_ws2, 2, root, timeout=900)
    src = os.path.join(root, "verl_own", "global_step_3", "actor")
    assert main(["convert", "--from", "verl-fsdp", src, os.path.join(root, "converted")]) == 0
    return root, outs


def test_save_ws2_async_retention_roles_and_verl_own_resume(saved) -> None:
    root, outs = saved
    r0 = outs[0]
    assert "verl.workers.engine.fsdp.transformer_impl" in r0["installed"]
    assert r0["patched"] == "UnickptFSDPCheckpointManager"
    # max_ckpt_to_keep=2: global_step_1 lost unickpt's files and the HF files; the user's file stays
    assert r0["files"]["global_step_1"] == ["notes.txt"]
    for step in ("global_step_2", "global_step_3"):
        assert "unickpt.metadata.json" in r0["files"][step] and "huggingface" in r0["files"][step]
    assert not any(n.endswith(".pt") for n in r0["files"]["global_step_3"])  # no world size in any name
    assert r0["shared"] == ["actor", "critic"]
    assert r0["saved"]["optim"] and r0["saved"]["sched"]["last_epoch"] == 3
    assert r0["saved_async"]["sched"]["last_epoch"] == 2
    for out in outs:
        assert_same_tree(out["saved"], out["resumed"], "unickpt resume ws2")
        assert_same_tree(out["saved_async"], out["resumed_async"], "async save (step 2) resume ws2")
        assert_same_tree(out["saved"], out["verl_resumed"], "verl's own resume ws2")
        assert_same_tree(out["saved"]["params"], out["model_only"]["params"], "load_contents=[model]")
        assert out["model_only"]["optim"] == {}  # the optimizer was not loaded
    # hf_model: the full model written by rank 0 beside the checkpoint (verl's gathered state dict)
    from safetensors.torch import load_file

    hf = load_file(os.path.join(root, "run", "global_step_3", "actor", "huggingface", "model.safetensors"))
    for name, value in r0["saved"]["params"].items():
        assert torch.equal(hf[name], value), name


def test_fsdp2_cpu_offload_policy_resume(saved) -> None:
    """verl's ``offload_policy: true`` (FSDP2 ``CPUOffloadPolicy``): an async save of the offloaded
    shards resumes bit-exact at ws=2 (the step-3 checkpoint loads into offloaded models at ws=1
    and ws=3: test_resume_at_other_world_sizes)."""
    _, outs = saved
    for out in outs:
        assert out["offload_policies"] == ["CPUOffloadPolicy"]
        assert out["offload_saved"]["optim"] and out["offload_saved"]["sched"]["last_epoch"] == 2
        assert_same_tree(out["offload_saved"], out["offload_resumed"], "CPUOffloadPolicy resume ws2")


def test_fsdp1_resume_and_convert(saved) -> None:
    """verl's default FSDP1: unickpt's manager resumes bit-exact at ws=2; verl's own FSDP1
    checkpoint converts (model; its flat-parameter optimizer state is listed as not converted)."""
    import unickpt
    from unickpt.ops.convert import from_verl_fsdp

    root, outs = saved
    want = outs[0]["fsdp1_saved"]
    for out in outs:
        assert_same_tree(want, out["fsdp1_resumed"], "fsdp1 resume ws2")
    result = from_verl_fsdp(os.path.join(root, "verl_fsdp1", "actor"), os.path.join(root, "fsdp1_converted"))
    assert "FSDP1" in result.layout and any("flat parameters" in s for s in result.skipped)
    flat = unickpt.FlatTensors({f"model.{k}": torch.zeros_like(v) for k, v in want.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the optimizer, scheduler and RNG entries are not asked for
        unickpt.load(os.path.join(root, "fsdp1_converted"), {"model": flat}, framework="tensors", strict=False)
    assert_same_tree({f"model.{k}": v for k, v in want.items()}, dict(flat), "fsdp1 convert")


@pytest.mark.parametrize("ws", [1, 3])
def test_resume_at_other_world_sizes(saved, ws: int) -> None:
    root, outs = saved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run_ranks(load_other_ws, ws, root, timeout=900)
    for rank, out in enumerate(got):
        want = outs[rank % 2]["saved"]  # params, optimizer, scheduler equal on every rank; RNG per rank
        for which in ("resumed", "converted"):
            assert_same_tree(want["params"], out[which]["params"], f"{which} params ws{ws}")
            assert_same_tree(want["optim"], out[which]["optim"], f"{which} optim ws{ws}")
            assert_same_tree(want["groups"], out[which]["groups"], f"{which} groups ws{ws}")
            assert_same_tree(want["sched"], out[which]["sched"], f"{which} sched ws{ws}")
        assert_same_tree(want["rng"], out["resumed"]["rng"], f"rng ws{ws} (saved rank r % 2)")
        assert_same_tree(outs[rank % 2]["saved_async"], out["resumed_async"], f"async save (step 2) ws{ws}")
        assert_same_tree(want, out["offload_resumed"], f"into CPUOffloadPolicy ws{ws}")
        assert out["offload_loss"] == outs[0]["saved_loss"]
        assert_same_tree(outs[0]["saved"]["rng"], out["converted"]["rng"], f"converted rng ws{ws} (rank 0's)")
        assert_same_tree(outs[0]["critic"], {**out["critic"], "rng": outs[0]["critic"]["rng"]}, f"critic role ws{ws}")
        assert out["loss"] == outs[0]["saved_loss"]
        assert_same_tree(outs[0]["fsdp1_saved"], out["fsdp1_into_fsdp2"], f"FSDP1 ws2 -> FSDP2 ws{ws}")


def test_install_and_lazy_import() -> None:
    import subprocess

    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.workers.engine.fsdp import transformer_impl

    from unickpt.integrations.verl import UnickptFSDPCheckpointManager, install, uninstall

    try:
        assert "verl.workers.engine.fsdp.transformer_impl" in install()
        assert transformer_impl.FSDPCheckpointManager is UnickptFSDPCheckpointManager
        assert issubclass(UnickptFSDPCheckpointManager, FSDPCheckpointManager)
    finally:
        uninstall()
    assert transformer_impl.FSDPCheckpointManager is FSDPCheckpointManager
    # one process: `import unickpt` imports no verl; then verl's own external-module hook installs
    code = (
        "import os, sys, unickpt; assert not [m for m in sys.modules if m.startswith('verl')]\n"
        "os.environ['VERL_USE_EXTERNAL_MODULES'] = 'unickpt.integrations.verl_install'\n"
        "from verl.workers.engine.fsdp import transformer_impl as t\n"
        "assert t.FSDPCheckpointManager.__name__ == 'UnickptFSDPCheckpointManager', t.FSDPCheckpointManager"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ----------------------------------------------------------------------------- hostile inputs


def _convert(src: str, out: str) -> Any:
    from unickpt.ops.convert import from_verl_fsdp

    return from_verl_fsdp(src, out)


def test_convert_plain_single_rank_file(tmp_path) -> None:
    import unickpt

    src = tmp_path / "src"
    src.mkdir()
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    torch.save({"w": w, "b": torch.ones(2, dtype=torch.bfloat16)}, src / "model_world_size_1_rank_0.pt")
    result = _convert(str(src), str(tmp_path / "out"))
    assert result.tensors == 2
    flat = unickpt.FlatTensors({"model.w": torch.zeros(2, 3), "model.b": torch.zeros(2, dtype=torch.bfloat16)})
    unickpt.load(str(tmp_path / "out"), {"model": flat}, framework="tensors")
    assert torch.equal(flat["model.w"], w) and torch.equal(flat["model.b"], torch.ones(2, dtype=torch.bfloat16))


def _zip_with(path: Any, pkl: bytes, extra: dict[str, bytes] | None = None, compress: int = zipfile.ZIP_STORED) -> None:
    with zipfile.ZipFile(path, "w", compression=compress) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
        for name, data in (extra or {}).items():
            z.writestr(f"archive/{name}", data)


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("touch pwned",))


def test_convert_refuses_a_pickle_with_code_before_it_runs(tmp_path, monkeypatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    monkeypatch.chdir(tmp_path)
    _zip_with(src / "model_world_size_1_rank_0.pt", pickle.dumps({"w": _Evil()}, protocol=2))
    with pytest.raises(CorruptMetadataError, match="system"):
        _convert(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "out").exists()
    # state set on a stand-in class itself, and getattr reaching past the recorded classes
    shard = b"ctorch.distributed.tensor.placement_types\nShard\n"
    poison = b"\x80\x02" + shard + b"}X\x03\x00\x00\x00dimK\x00sb."
    dunder = b"\x80\x02c__builtin__\ngetattr\n(" + shard + b"X\x08\x00\x00\x00__dict__tR."
    for pkl, match in ((poison, "sets attributes on the class"), (dunder, "attribute '__dict__'")):
        _zip_with(src / "model_world_size_1_rank_0.pt", pkl)
        with pytest.raises(CorruptMetadataError, match=match):
            _convert(str(src), str(tmp_path / "out"))


def test_convert_refuses_links_compressed_oversized_and_short_storages(tmp_path, monkeypatch) -> None:
    from unickpt.ops import torch_save_read

    real = tmp_path / "real.pt"
    torch.save({"w": torch.ones(4)}, real)
    src = tmp_path / "link"
    src.mkdir()
    os.symlink(real, src / "model_world_size_1_rank_0.pt")
    with pytest.raises(UnsafePathError):
        _convert(str(src), str(tmp_path / "o1"))
    # a compressed entry (a zip bomb's way): torch.save never compresses
    buf = io.BytesIO()
    torch.save({"w": torch.ones(4)}, buf)
    src = tmp_path / "zipped"
    src.mkdir()
    with (
        zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z,
        zipfile.ZipFile(src / "model_world_size_1_rank_0.pt", "w", compression=zipfile.ZIP_DEFLATED) as out,
    ):
        for info in z.infolist():
            out.writestr(info.filename, z.read(info))
    with pytest.raises(CorruptMetadataError, match="compressed"):
        _convert(str(src), str(tmp_path / "o2"))
    # a storage shorter than the tensor it backs
    src = tmp_path / "short"
    src.mkdir()
    with (
        zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z,
        zipfile.ZipFile(src / "model_world_size_1_rank_0.pt", "w") as out,
    ):
        for info in z.infolist():
            data = z.read(info)
            out.writestr(info.filename, data[:8] if info.filename.endswith("data/0") else data)
    with pytest.raises(CorruptMetadataError, match="holds 8 bytes"):
        _convert(str(src), str(tmp_path / "o3"))
    # an oversized data.pkl is refused before it is read
    monkeypatch.setattr(torch_save_read, "PICKLE_LIMIT", 16)
    src = tmp_path / "big"
    src.mkdir()
    (src / "model_world_size_1_rank_0.pt").write_bytes(buf.getvalue())
    with pytest.raises(SizeLimitError, match="data.pkl"):
        _convert(str(src), str(tmp_path / "o4"))


def test_convert_refuses_missing_ranks_mixed_sizes_and_untiled_pieces(tmp_path) -> None:
    from unickpt.ops.verl_read import Box, assemble

    src = tmp_path / "missing"
    src.mkdir()
    torch.save({"w": torch.ones(2)}, src / "model_world_size_2_rank_0.pt")
    with pytest.raises(CorruptMetadataError, match="missing for ranks \\[1\\]"):
        _convert(str(src), str(tmp_path / "o1"))
    torch.save({"w": torch.ones(2)}, src / "model_world_size_3_rank_1.pt")
    with pytest.raises(CorruptMetadataError, match="several world sizes"):
        _convert(str(src), str(tmp_path / "o2"))
    (tmp_path / "nothing" / "missing").mkdir(parents=True)  # a folder of folders, no rank file (output outside it)
    with pytest.raises(CheckpointError, match="not a verl FSDP checkpoint"):
        _convert(str(tmp_path / "nothing"), str(tmp_path / "o3"))
    two = [Box((0,), (2,), torch.ones(2)), Box((1,), (2,), torch.ones(2))]  # overlapping halves of 3
    with pytest.raises(CorruptMetadataError, match="not tiled"):
        assemble("w", (3,), torch.float32, two)
    with pytest.raises(CorruptMetadataError, match="shape"):
        assemble("w", (4,), torch.float32, [Box((0,), (4,), torch.ones(3))])


@pytest.mark.parametrize("content", [b"", b"garbage", b"PK\x03\x04 torn zip"])
def test_cli_convert_on_broken_rank_files_prints_one_line(tmp_path, capsys, content: bytes) -> None:
    from unickpt.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "model_world_size_1_rank_0.pt").write_bytes(content)
    assert main(["convert", "--from", "verl-fsdp", str(src), str(tmp_path / "out")]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("unickpt convert: error: "), err
    assert "model_world_size_1_rank_0.pt" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "out").exists()
