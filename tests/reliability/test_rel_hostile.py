"""Hostile checkpoints: loading never runs code from them, and absurd sizes are refused before
anything is allocated."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import textwrap

import crc32c
import pytest
import torch

import unickpt
from tests.workers.rel_helpers import tiny_model
from unickpt.format.records import METADATA_FILE


class _Evil:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def payload(tmp_path):
    """A live pickle payload: proven to create ``marker`` when unpickled (in a subprocess)."""
    marker = str(tmp_path / "PWNED")
    data = pickle.dumps(_Evil(marker), protocol=2)
    probe = tmp_path / "probe.pkl"
    probe.write_bytes(data)
    subprocess.run(
        [sys.executable, "-c", f"import pickle; pickle.loads(open({str(probe)!r}, 'rb').read())"], check=True
    )
    assert os.path.exists(marker)  # the payload works...
    os.unlink(marker)
    return data, marker


@pytest.fixture
def no_unpickling(monkeypatch):
    """Record any use of pickle / torch.load during the test (there must be none). The spies
    delegate, so they change nothing but the record."""
    calls = []

    def spy(name, real):
        def f(*a, **k):
            calls.append(name)
            return real(*a, **k)

        return f

    class SpyUnpickler(pickle.Unpickler):
        def __init__(self, *a, **k):
            calls.append("pickle.Unpickler")
            super().__init__(*a, **k)

    monkeypatch.setattr(pickle, "loads", spy("pickle.loads", pickle.loads))
    monkeypatch.setattr(pickle, "load", spy("pickle.load", pickle.load))
    monkeypatch.setattr(pickle, "Unpickler", SpyUnpickler)
    monkeypatch.setattr(torch, "load", spy("torch.load", torch.load))
    return calls


def _save(tmp_path, extra=None):
    model, optim = tiny_model()
    ckpt = str(tmp_path / "ck")
    unickpt.save(ckpt, {"model": model, "optimizer": optim, "extra_state": extra or {"step": 1}}, framework="torch")
    return ckpt, json.loads(open(os.path.join(ckpt, METADATA_FILE), "rb").read())


def _rechecksum(ckpt: str, md: dict) -> None:
    """Make the metadata's checksums match the data files as they are now (sizes and the CRC32C
    of every chunk): a hostile writer can always do that."""
    chunk = md["checksums"]["chunk_size"]
    sizes, crcs = [], b""
    for name in md["files"]:
        data = open(os.path.join(ckpt, name), "rb").read()
        sizes.append(len(data))
        crcs += b"".join(crc32c.crc32c(data[i : i + chunk]).to_bytes(4, "little") for i in range(0, len(data), chunk))
    md["checksums"]["file_sizes"] = sizes
    md["checksums"]["crcs"] = base64.b64encode(crcs).decode()


def _load(ckpt):
    model, optim = tiny_model(seed=9)
    state = {"model": model, "optimizer": optim, "extra_state": None}
    unickpt.load(ckpt, state, framework="torch")
    return state


def test_pickle_as_the_metadata_file(tmp_path, payload, no_unpickling):
    data, marker = payload
    ckpt, _ = _save(tmp_path)
    open(os.path.join(ckpt, METADATA_FILE), "wb").write(data)
    with pytest.raises(unickpt.CorruptMetadataError, match="not valid JSON|magic"):
        _load(ckpt)
    assert not os.path.exists(marker) and no_unpickling == []


def test_pickle_inside_the_extra_state_blob(tmp_path, payload, no_unpickling):
    """The blob is swapped for the pickle with a matching checksum: it passes the integrity
    check, and the safe decoder refuses it."""
    data, marker = payload
    ckpt, md = _save(tmp_path)
    evil_file = md["files"][0].rsplit("/", 1)[0] + "/evil.bin"
    open(os.path.join(ckpt, evil_file), "wb").write(data)
    md["files"].append(evil_file)
    md["blobs"]["extra_state/rank0"] = [len(md["files"]) - 1, 0, len(data)]
    _rechecksum(ckpt, md)
    open(os.path.join(ckpt, METADATA_FILE), "w").write(json.dumps(md))
    with pytest.raises(unickpt.CorruptMetadataError, match="extra_state/rank0"):
        _load(ckpt)
    assert not os.path.exists(marker) and no_unpickling == []


def test_pickle_as_an_extra_state_bytes_value_is_returned_not_run(tmp_path, payload, no_unpickling):
    data, marker = payload
    ckpt, _ = _save(tmp_path, extra={"blob": data, "nested": [{"also": data}]})
    state = _load(ckpt)
    assert state["extra_state"]["blob"] == data and type(state["extra_state"]["blob"]) is bytes
    assert state["extra_state"]["nested"][0]["also"] == data
    assert not os.path.exists(marker) and no_unpickling == []


def test_pickle_as_tensor_bytes_is_just_numbers(tmp_path, payload, no_unpickling):
    data, marker = payload
    ckpt, md = _save(tmp_path)
    t = md["tensors"]["model.0.weight"]  # float32 [16, 8] = 512 bytes
    nd = len(t["shape"])
    fidx, boff = t["shards"][0][2 * nd : 2 * nd + 2]
    blen = 4 * 16 * 8
    raw = (data * (blen // len(data) + 1))[:blen]
    with open(os.path.join(ckpt, md["files"][fidx]), "r+b") as f:
        f.seek(boff)
        f.write(raw)
    _rechecksum(ckpt, md)
    open(os.path.join(ckpt, METADATA_FILE), "w").write(json.dumps(md))
    state = _load(ckpt)
    got = state["model"][0].weight.detach().contiguous().view(torch.uint8).reshape(-1)
    assert bytes(got.numpy()) == raw  # loaded as raw tensor bytes, never interpreted
    assert not os.path.exists(marker) and no_unpickling == []


# ----------------------------------------------------------------------------- absurd sizes

_ABSURD = textwrap.dedent("""
    import json, os, resource, sys, tracemalloc
    import torch
    torch.set_num_threads(1)
    tests = os.path.dirname(sys.argv[2])
    sys.path[:0] = [os.path.dirname(tests)]  # the repo root: tests.workers
    import unickpt
    from unickpt.format.records import METADATA_FILE
    from tests.workers.rel_helpers import tiny_model

    ckpt = sys.argv[1]
    meta = os.path.join(ckpt, METADATA_FILE)
    good = open(meta, "rb").read()
    vm = int([l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize")][0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
    cases = json.loads(open(sys.argv[3]).read())
    out = {}
    for name, doc in cases.items():
        open(meta, "w").write(json.dumps(doc))
        model, optim = tiny_model(seed=9)
        tracemalloc.start()
        try:
            unickpt.load(ckpt, {"model": model, "optimizer": optim, "extra_state": None}, framework="torch")
            kind, msg = "loaded", ""
        except unickpt.CheckpointError as e:
            kind, msg = type(e).__name__, str(e)
        except BaseException as e:
            kind, msg = "NOT A CheckpointError: " + type(e).__name__, str(e)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        out[name] = [kind, msg[:300], peak]
    open(meta, "wb").write(good)
    print(json.dumps(out))
""")


def _mutations(md: dict) -> dict[str, tuple[dict, str]]:
    """name -> (metadata, expected error type)."""

    def clone():
        return json.loads(json.dumps(md))

    w = "model.0.weight"
    nd = len(md["tensors"][w]["shape"])
    out = {}
    d = clone()
    d["tensors"][w]["shards"][0][2 * nd + 1] = -4096
    out["negative byte offset"] = (d, "CorruptMetadataError")
    d = clone()
    b = md["tensors"]["model.0.bias"]
    d["tensors"]["model.0.bias"]["shards"][0][2 + 0] = md["tensors"][w]["shards"][0][2 * nd]
    d["tensors"]["model.0.bias"]["shards"][0][2 + 1] = md["tensors"][w]["shards"][0][2 * nd + 1]
    out["overlapping byte ranges"] = (d, "CorruptMetadataError")
    d = clone()
    d["tensors"][w]["shards"][0][2 * nd + 1] = 1 << 40
    out["offset beyond the file"] = (d, "CorruptMetadataError")  # past the file size the metadata records
    d = clone()
    d["tensors"][w]["shape"] = [10**15, 8]
    d["tensors"][w]["shards"][0][2:4] = [10**15, 8]
    out["shape of 8e15 elements"] = (d, "CorruptMetadataError")
    d = clone()
    d["tensors"][w]["shape"] = [10**13, 8]
    d["tensors"][w]["shards"][0][2:4] = [10**13, 8]
    d["tensors"][w]["shards"][0][2 * nd + 1] = 1 << 30  # no overlap
    # its bytes end past the recorded file size: claiming such a file needs 4 bytes of checksum
    # per MiB of it, so a claim is bounded by the metadata's own size
    out["shape of 8e13 elements"] = (d, "CorruptMetadataError")
    d = clone()
    d["checksums"]["file_sizes"][0] = 1 << 50
    out["file of 2^50 bytes"] = (d, "CorruptMetadataError")
    d = clone()
    d["blobs"]["extra_state/rank0"][2] = 1 << 60
    out["blob of 2^60 bytes"] = (d, "CorruptMetadataError")
    d = clone()
    d["blobs"]["extra_state/rank0"][1:3] = [1 << 30, 1 << 40]  # past every other range
    out["blob of 2^40 bytes"] = (d, "CorruptMetadataError")
    d = clone()
    d["tensors"][w]["shards"][0][2 * nd] = 10**9
    out["file index out of range"] = (d, "CorruptMetadataError")
    d = clone()
    d["tensors"][w]["shards"] = []
    out["tensor without shards"] = (d, "CorruptMetadataError")
    d = clone()
    d["tensors"][w]["shape"] = [1] * 100_000
    out["100k dimensions"] = (d, "CorruptMetadataError")
    del b
    return out


def test_absurd_sizes_are_refused_before_any_allocation(tmp_path):
    """Run in a subprocess whose address space is capped at +1 GiB: any attempt to allocate what
    the metadata claims would raise MemoryError/RuntimeError instead of a CheckpointError."""
    ckpt, md = _save(tmp_path)
    cases = _mutations(md)
    here = os.path.dirname(__file__)
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps({k: v[0] for k, v in cases.items()}))
    r = subprocess.run(
        [sys.executable, "-c", _ABSURD, ckpt, here, str(spec)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for name, (_, expected) in cases.items():
        kind, msg, peak = got[name]
        assert kind == expected, (name, kind, msg)
        assert peak < 32 << 20, (name, peak)  # no big Python-side allocation either
    assert "absurd" in got["blob of 2^60 bytes"][1]
    assert "ends past" in got["blob of 2^40 bytes"][1]
    assert "chunk checksums need" in got["file of 2^50 bytes"][1]
