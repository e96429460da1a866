"""``RestoreOptions(resize_plain_tensors=True)`` (engine.load.resize), one process: a plain tensor
saved with another shape than the live one (a buffer the model grew while it trained) is handed
to its module's own ``load_state_dict`` or rebound in ``FlatTensors``; without the option, and
for a DTensor always, the load raises ``ShapeMismatchError``; a saved shape the data files do not
back is refused before anything of that size is allocated; the metadata is read once."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import unickpt
from tests.fixtures.format_sums import chunk_sums
from tests.fixtures.metadata_reads import count_metadata_reads
from unickpt.errors import ResizeRefusedError, ShapeMismatchError, TruncatedDataFileError
from unickpt.format import METADATA_FILE, ShardRecord, decode_metadata
from unickpt.format.codec import encode_metadata
from unickpt.frameworks.base import StateDescription
from unickpt.frameworks.module_state import tensor_piece
from unickpt.frameworks.plain import flat_plain_tensors
from unickpt.frameworks.registry import FRAMEWORKS
from unickpt.frameworks.views import DescribedAdapter
from unickpt.options import RestoreOptions

RESIZE = unickpt.LoadOptions(restore=RestoreOptions(resize_plain_tensors=True))
SEEN = [0.5, -1.25, 3.0, 7.75]  # what the trained model's buffer holds


class Grows(nn.Module):
    """A linear layer and ``seen``, a buffer that grows as it trains; ``resizes``: its
    ``load_state_dict`` takes a ``seen`` of another shape (as a model that grows a buffer must)."""

    def __init__(self, resizes: bool = True, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(0))
        self.resizes = resizes

    def load_state_dict(self, state_dict, strict=True, assign=False):  # type: ignore[no-untyped-def]
        if self.resizes and "seen" in state_dict and state_dict["seen"].shape != self.seen.shape:
            self.seen = torch.empty_like(state_dict["seen"])
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _saved(path: str) -> Grows:
    model = Grows(seed=1)
    model.seen = torch.tensor(SEEN)
    unickpt.save(path, {"model": model})
    return model


def test_a_grown_buffer_loads_with_the_option_and_is_a_shape_mismatch_without(tmp_path) -> None:
    path = str(tmp_path / "ck")
    saved = _saved(path)
    fresh = Grows(seed=2)
    before = fresh.fc.weight.detach().clone()
    with pytest.raises(ShapeMismatchError, match="model.seen: checkpoint shape") as info:
        unickpt.load(path, {"model": fresh})
    assert not isinstance(info.value, ResizeRefusedError)
    assert fresh.seen.shape == (0,) and torch.equal(fresh.fc.weight, before)  # refused before anything changed

    unickpt.load(path, {"model": fresh}, options=RESIZE)
    assert torch.equal(fresh.seen, torch.tensor(SEEN))
    assert torch.equal(fresh.fc.weight, saved.fc.weight) and torch.equal(fresh.fc.bias, saved.fc.bias)


@pytest.mark.parametrize("stage_before_apply", [False, True])
def test_a_module_whose_load_state_dict_does_not_resize_raises_pytorchs_size_mismatch(
    tmp_path, stage_before_apply: bool
) -> None:
    path = str(tmp_path / "ck")
    _saved(path)
    fresh = Grows(resizes=False, seed=2)
    before = fresh.fc.weight.detach().clone()
    options = dataclasses.replace(RESIZE, stage_before_apply=stage_before_apply)
    with pytest.raises(ResizeRefusedError, match="size mismatch for seen") as info:
        unickpt.load(path, {"model": fresh}, options=options)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ShapeMismatchError)
    assert fresh.seen.shape == (0,)
    if stage_before_apply:  # verified bytes only, nothing live touched before the refusal
        assert torch.equal(fresh.fc.weight, before)
    else:
        assert "partially overwritten" in str(info.value)


def test_a_flat_tensors_entry_is_rebound_to_the_saved_shape(tmp_path) -> None:
    path = str(tmp_path / "ck")
    unickpt.save(path, {"model": unickpt.FlatTensors({"a": torch.arange(6.0), "b": torch.ones(2)})})
    b = torch.zeros(2)
    flat = unickpt.FlatTensors({"a": torch.zeros(2), "b": b})
    with pytest.raises(ShapeMismatchError, match="a: checkpoint shape"):
        unickpt.load(path, {"model": flat})
    unickpt.load(path, {"model": flat}, options=RESIZE)
    assert torch.equal(flat["a"], torch.arange(6.0))
    assert flat["b"] is b and torch.equal(b, torch.ones(2))  # same shape: loaded in place, as always


class _Sharded(nn.Module):
    def __init__(self, n: int, mesh) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        self.w = nn.Parameter(distribute_tensor(torch.arange(float(n)), mesh, [Shard(0)]))


def test_a_dtensor_saved_with_another_global_shape_is_still_a_shape_mismatch(tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with unickpt.Checkpointer() as ck:
            ck.save(str(tmp_path / "ck"), {"model": _Sharded(4, mesh)})
            live = _Sharded(2, mesh)
            with pytest.raises(ShapeMismatchError, match="model.w: checkpoint shape") as info:
                ck.load(str(tmp_path / "ck"), {"model": live}, options=RESIZE)
        assert not isinstance(info.value, ResizeRefusedError)
        assert live.w.shape == (2,)
    finally:
        dist.destroy_process_group()


def test_a_huge_saved_shape_the_files_do_not_hold_is_refused_before_allocating(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "ck")
    _saved(path)
    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        md = decode_metadata(f.read())
    rec = md.tensors["model.seen"]
    fidx = rec.shards[0].file_index
    ends = [s.byte_offset + s.byte_length for t in md.tensors.values() for s in t.shards if s.file_index == fidx]
    ends += [b.byte_offset + b.byte_length for b in md.blobs.values() if b.file_index == fidx]
    n = 1 << 42  # 16 TiB of float32: the shards tile it, the data file is a few hundred bytes
    claim = ShardRecord((0,), (n,), fidx, max(ends), 4 * n)
    tensors = {**md.tensors, "model.seen": dataclasses.replace(rec, shape=(n,), shards=(claim,))}
    hostile = dataclasses.replace(md, tensors=tensors, checksums=chunk_sums(md.files, tensors, md.blobs, chunk=1 << 30))
    with open(os.path.join(path, METADATA_FILE), "wb") as f:
        f.write(encode_metadata(hostile))

    asked: list[int] = []
    empty = torch.empty

    def watched(*size, **kw):  # type: ignore[no-untyped-def]
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        asked.append(int(torch.Size(shape).numel()))
        return empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", watched)
    with pytest.raises(TruncatedDataFileError, match="model.seen"):
        unickpt.load(path, {"model": Grows(seed=2)}, options=RESIZE)
    assert all(k < n for k in asked)


def test_the_metadata_is_read_once(tmp_path) -> None:
    reads = count_metadata_reads("mdcount")
    _saved(str(tmp_path / "ck"))
    fresh = Grows(seed=2)
    unickpt.load(f"mdcount://{tmp_path}/ck", {"model": fresh}, options=RESIZE)
    assert torch.equal(fresh.seen, torch.tensor(SEEN))
    assert len(reads) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_grown_buffer_on_the_gpu_loads_on_the_gpu(tmp_path) -> None:
    path = str(tmp_path / "ck")
    saved = _saved(path)
    fresh = Grows(seed=2).cuda()
    unickpt.load(path, {"model": fresh}, options=RESIZE)
    assert fresh.seen.device.type == "cuda" and torch.equal(fresh.seen.cpu(), torch.tensor(SEEN))
    assert torch.equal(fresh.fc.weight.cpu(), saved.fc.weight)


class _Table(dict):  # type: ignore[type-arg]
    """A framework's own container of tensors (no built-in adapter knows it)."""


class _TableAdapter(DescribedAdapter):
    """An adapter that owns its type: it describes a ``_Table`` and names its plain tensors."""

    name = "issue41_table"

    def matches(self, state):  # type: ignore[no-untyped-def]
        return isinstance(state.get("model"), _Table)

    def describe(self, state):  # type: ignore[no-untyped-def]
        table = state.get("model")
        return None if table is None else StateDescription(tuple(tensor_piece(k, t, None) for k, t in table.items()))

    def plain_tensors(self, state):  # type: ignore[no-untyped-def]
        return flat_plain_tensors(state["model"])


def test_issue41_item3_an_adapter_resizes_its_own_types_through_plain_tensors(tmp_path) -> None:
    """The engine's resize asks the adapter (``plain_tensors``) instead of testing for the built-in
    adapters' types: a registered adapter of its own container resizes like FlatTensors."""
    FRAMEWORKS.register(_TableAdapter(), priority=None)
    try:
        path = str(tmp_path / "ck")
        unickpt.save(path, {"model": _Table(w=torch.arange(6.0), seen=torch.tensor(SEEN))}, framework="issue41_table")
        live = _Table(w=torch.zeros(6), seen=torch.zeros(0))
        with pytest.raises(ShapeMismatchError, match="seen"):
            unickpt.load(path, {"model": live}, framework="issue41_table")
        unickpt.load(path, {"model": live}, framework="issue41_table", options=RESIZE)
        assert live["seen"].tolist() == SEEN and live["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        FRAMEWORKS.unregister("issue41_table")
