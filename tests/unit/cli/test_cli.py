"""The ``unickpt`` command line: ``inspect`` (text, --json, --verify, error exits) and ``demo``.

Most inspect checks call ``cli.main`` in-process (fast); the entry points (``python -m unickpt``,
the console script), the error exits required to be traceback-free and the demo run as real
subprocesses with the venv's python.

Its tests that start processes are in ``tests/integration/tools/test_cli_processes.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from unickpt import cli
from unickpt.format import METADATA_FILE, Metadata, decode_metadata
from unickpt.ops import inspect as ins
from unickpt.testing.toy import build, train_step


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Metadata]:
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    model, optim = build("torch")
    train_step(model, optim, 0)
    state = {"model": model, "optimizer": optim, "extra_state": {"step": 1}}
    # small checksum chunks, so that corruptions of different tensors land in different chunks
    options = unickpt.SaveOptions(checksum_chunk_bytes=4096)
    unickpt.save(str(path), state, framework="torch", options=options).wait()
    return path, decode_metadata((path / METADATA_FILE).read_bytes())


@pytest.fixture
def copy(saved: tuple[Path, Metadata], tmp_path: Path) -> tuple[Path, Metadata]:
    """A private copy of the checkpoint that a test may damage."""
    import shutil

    src, md = saved
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst, md


def main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- inspect


def test_summary_matches_metadata(saved: tuple[Path, Metadata]) -> None:
    path, md = saved
    s = ins.summarize(md, str(path))
    assert [t.fqn for t in s.tensors] == list(md.tensors)
    for t in s.tensors:
        rec = md.tensors[t.fqn]
        assert (t.dtype, t.shape, t.shards) == (rec.dtype, rec.shape, len(rec.shards))
        assert t.bytes == sum(x.byte_length for x in rec.shards)
    assert s.totals.tensors == len(md.tensors)
    assert s.totals.tensor_bytes == md.total_tensor_bytes
    assert s.totals.blobs == len(md.blobs) == 1 and s.blobs[0].key == "extra_state/rank0"
    assert [f.name for f in s.files] == list(md.files)
    assert s.totals.file_bytes >= md.total_tensor_bytes + s.totals.blob_bytes  # may hold alignment padding
    assert (s.framework, s.world_size, s.mesh) == ("torch", 1, ())
    assert s.objects == ["optimizer", "state_keys"] and not s.sizes_checked  # state_keys: issue 27


def test_inspect_text(saved: tuple[Path, Metadata], capsys: pytest.CaptureFixture[str]) -> None:
    path, md = saved
    code, out, err = main(capsys, "inspect", str(path))
    assert code == 0 and not err
    n_shards = sum(len(t.shards) for t in md.tensors.values())
    assert f"{len(md.tensors)} tensors, {n_shards} shards" in out
    assert f"({md.total_tensor_bytes} bytes)" in out
    assert f"{len(md.files)} files" in out
    assert md.save_id in out and "format version  3" in out
    assert "framework torch, world size 1" in out
    for fqn, t in md.tensors.items():
        line = next(x for x in out.splitlines() if x.split()[:1] == [fqn])
        assert line.split()[1] == t.dtype and line.split()[-1] == str(sum(s.byte_length for s in t.shards))
    for name in md.files:
        size = (path / name).stat().st_size
        line = next(x for x in out.splitlines() if name in x and "extra_state" not in x)
        assert line.split()[-1] == str(size)  # the ON DISK column
    assert "extra_state/rank0" in out and "WARNING" not in out


def test_inspect_json(saved: tuple[Path, Metadata], capsys: pytest.CaptureFixture[str]) -> None:
    path, md = saved
    code, out, _ = main(capsys, "inspect", str(path), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["format_version"] == md.format_version and doc["save_id"] == md.save_id
    assert doc["created_unix"] == md.created_unix and doc["role"] is None
    assert doc["topology"] == {"framework": "torch", "world_size": 1, "mesh": []}
    assert [t["fqn"] for t in doc["tensors"]] == list(md.tensors)
    for t in doc["tensors"]:
        rec = md.tensors[t["fqn"]]
        assert t["shape"] == list(rec.shape) and t["dtype"] == rec.dtype and t["shards"] == len(rec.shards)
        assert t["bytes"] == sum(s.byte_length for s in rec.shards)
    totals = doc["totals"]
    assert totals["tensors"] == len(md.tensors) and totals["files"] == len(md.files)
    assert totals["tensor_bytes"] == md.total_tensor_bytes
    assert totals["shards"] == sum(len(t.shards) for t in md.tensors.values())
    assert totals["blobs"] == 1 and totals["metadata_bytes"] == (path / METADATA_FILE).stat().st_size
    assert {f["name"]: f["size_on_disk"] for f in doc["files"]} == {n: (path / n).stat().st_size for n in md.files}
    assert doc["blobs"][0]["key"] == "extra_state/rank0" and doc["verify"] is None


def test_inspect_verify_ok(saved: tuple[Path, Metadata], capsys: pytest.CaptureFixture[str]) -> None:
    path, md = saved
    code, out, _ = main(capsys, "inspect", str(path), "--verify", "--json")
    assert code == 0
    v = json.loads(out)["verify"]
    assert v["ok"] and v["failures"] == [] and v["blobs_checked"] == 1
    assert v["shards_checked"] == sum(len(t.shards) for t in md.tensors.values())
    assert v["bytes_checked"] == md.total_tensor_bytes + sum(b.byte_length for b in md.blobs.values())


def test_inspect_verify_finds_every_corrupt_shard(
    copy: tuple[Path, Metadata], capsys: pytest.CaptureFixture[str]
) -> None:
    path, md = copy
    bad = ["model.head.weight", "optimizer.state.blocks.1.fc1.weight.exp_avg"]
    for fqn in bad:
        s = md.tensors[fqn].shards[0]
        f = path / md.files[s.file_index]
        data = bytearray(f.read_bytes())
        data[s.byte_offset + 5] ^= 0xFF
        f.write_bytes(bytes(data))
    code, out, _ = main(capsys, "inspect", str(path), "--verify", "--summary")
    assert code == cli.EXIT_FAILED
    assert "verify: FAILED (2 problems)" in out
    failures = [x for x in out.splitlines() if "ChecksumMismatchError" in x]
    assert len(failures) == 2 and all(any(repr(b) in x for x in failures) for b in bad), failures


def test_inspect_reports_missing_file(copy: tuple[Path, Metadata], capsys: pytest.CaptureFixture[str]) -> None:
    path, md = copy
    (path / md.files[1]).unlink()
    code, out, _ = main(capsys, "inspect", str(path))
    assert code == cli.EXIT_FAILED  # the report is printed, and the exit code says it is broken
    assert "WARNING: 1 data file(s) missing" in out and f"{md.files[1]}: missing" in out
    code, out, _ = main(capsys, "inspect", str(path), "--verify", "--json")
    assert code == cli.EXIT_FAILED
    v = json.loads(out)["verify"]
    assert not v["ok"] and v["failures_total"] == 1  # one failure for the file, not one per shard
    assert "MissingDataFileError" in v["failures"][0] and md.files[1] in v["failures"][0]
    in_other = sum(1 for t in md.tensors.values() for s in t.shards if s.file_index != 1)
    assert v["shards_checked"] == in_other > 0


def test_item10_inspect_without_verify_fails_on_truncated_checkpoint(
    copy: tuple[Path, Metadata], capsys: pytest.CaptureFixture[str]
) -> None:
    """Data files shorter than the metadata says: the report is still printed (text and JSON),
    with a warning, and the exit code is 1, without --verify."""
    path, md = copy
    f = path / md.files[0]
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    code, out, _ = main(capsys, "inspect", str(path))
    assert code == cli.EXIT_FAILED
    assert "unickpt checkpoint" in out and "WARNING: 1 data file(s) missing or shorter" in out
    code, out, _ = main(capsys, "inspect", str(path), "--json")
    assert code == cli.EXIT_FAILED
    files = {x["name"]: x for x in json.loads(out)["files"]}
    assert files[md.files[0]]["size_on_disk"] < files[md.files[0]]["bytes"]
    code, _, _ = main(capsys, "inspect", str(path), "--summary")
    assert code == cli.EXIT_FAILED


def test_inspect_verify_truncated_file(copy: tuple[Path, Metadata], capsys: pytest.CaptureFixture[str]) -> None:
    path, md = copy
    f = path / md.files[0]
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    cut = sorted(
        fqn
        for fqn, t in md.tensors.items()
        for s in t.shards
        if s.file_index == 0 and s.byte_offset + s.byte_length > size - 100
    )
    cut += [k for k, b in md.blobs.items() if b.file_index == 0 and b.byte_offset + b.byte_length > size - 100]
    code, out, _ = main(capsys, "inspect", str(path), "--verify", "--max-failures", "1")
    assert code == cli.EXIT_FAILED
    assert "WARNING: 1 data file(s) missing or shorter" in out
    assert "verify: FAILED (1 problem" in out  # one per file, naming what the lost bytes held
    assert "TruncatedDataFileError" in out and md.files[0] in out and all(repr(k) in out for k in cut[:3])


def test_human_bytes() -> None:
    assert [ins.human_bytes(n) for n in (0, 1023, 1536, 5 << 30)] == ["0 B", "1023 B", "1.5 KiB", "5.0 GiB"]


@pytest.mark.parametrize(
    "damage,expected",
    [
        (lambda d: b"\x00garbage", "CorruptMetadataError"),
        (lambda d: d[: len(d) // 3], "CorruptMetadataError"),
        (lambda d: d.replace(b'"format_version":3', b'"format_version":99'), "UnsupportedFormatVersionError"),
    ],
)
def test_inspect_bad_metadata_exits_2(
    copy: tuple[Path, Metadata], capsys: pytest.CaptureFixture[str], damage: Any, expected: str
) -> None:
    path, _ = copy
    meta = path / METADATA_FILE
    meta.write_bytes(damage(meta.read_bytes()))
    code, out, err = main(capsys, "inspect", str(path))
    assert code == cli.EXIT_ERROR and out == ""
    assert err.startswith(f"unickpt inspect: error: {expected}: ") and str(meta) in err


def test_inspect_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unickpt.save(str(tmp_path), {"model": torch.nn.Linear(2, 2)}, framework="torch", role="critic").wait()
    code, out, _ = main(capsys, "inspect", str(tmp_path), "--role", "critic", "--summary")
    assert code == 0 and "role            critic" in out and "2 tensors" in out
    with pytest.raises(SystemExit) as info:
        cli.main(["inspect", str(tmp_path), "--role", "../x"])
    assert info.value.code == 2


# ----------------------------------------------------------------------------- demo


DEMO = Path(__file__).resolve().parents[3] / "examples" / "demo.py"  # tests/unit/cli/ -> the root


def test_demo_report_flags_mismatches() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("unickpt_example_demo", DEMO)
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = demo  # its dataclasses look their module up while being defined
    spec.loader.exec_module(demo)
    DemoConfig, _compare_state, _report = demo.DemoConfig, demo._compare_state, demo._report

    cfg = DemoConfig(out="/nonexistent", steps=2, save_every=2, extra_steps=2)
    a = {"model.w": torch.tensor([1.0, 2.0]), "optimizer.state.w.exp_avg": torch.zeros(2)}
    b = {"model.w": torch.tensor([1.0, 2.5]), "optimizer.state.w.exp_avg": torch.zeros(2)}
    assert _compare_state(a, a) == []
    assert "model.w: not bit-identical" in _compare_state(a, b)[0]
    train = [{"state": a, "losses": [3.0, 2.0, 1.5, 1.25], "saves": []}]
    none = {"state": [], "groups": [], "step": [], "rng": []}
    ok = [{"losses": [1.5, 1.25], "load_s": 0.1, "checks": none, "checked": 2}] * 2
    assert _report(cfg, train, ok, 1.0, 1.0).ok
    off = [{"losses": [1.5, 1.2500001], "load_s": 0.1, "checks": none, "checked": 2}] + ok[1:]
    result = _report(cfg, train, off, 1.0, 1.0)
    assert not result.ok and "resharding 4 -> 2: FAILED" in result.report and "step 3" in result.report
