"""Loads onto CUDA tensors (``engine.load.device``: pinned bounce buffers, host-to-device copies on
a side stream), bit-exact against the tensors that were saved.

Every test runs on ``cuda`` (``ReadOptions.pinned_device_copies``) and ``cuda-blocking`` (the option
off: host memory and blocking copies) where a GPU is present, and here on ``cpu`` (the plain CPU
path: no ``DeviceCopies`` is made) and ``cpu-bounced``: CPU destinations driven through the device path
(``DeviceCopies(pin=False)``: every contiguous destination bounced through a pool of two
buffers, so pieces also go unpooled; the box copies and casts under ``stream``), which proves
the wiring of that path on hosts without a GPU. Expected values are clones of the tensors handed
to the save (cast by torch itself for the cast case), never read back through unickpt.
Cases: the same layout (model + Adam state; several 16 MiB pieces, a medium bf16 tensor, small
tensors), loaded while the caller's current stream is a non-default one with work still queued
on the destinations; a dtype cast; partial boxes (whole rows, and rows x columns: a resharding
load's reads); a flipped byte still raising ``ChecksumMismatchError`` on the device path.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import unickpt
from unickpt.coordination import SingleProcessCoordinator
from unickpt.engine.load import device as device_mod
from unickpt.engine.load.stage import read_stage
from unickpt.errors import ChecksumMismatchError
from unickpt.format import METADATA_FILE, decode_metadata
from unickpt.options import ReadOptions, RestoreOptions
from unickpt.planning.load.overlap import plan_local_load
from unickpt.planning.load.shards import ShardIndex
from unickpt.planning.specs import LoadItem, ShardSpec
from unickpt.storage import open_storage

_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [
    "cpu",
    "cpu-bounced",
    pytest.param("cuda", marks=_NEEDS_CUDA),
    pytest.param("cuda-blocking", marks=_NEEDS_CUDA),
]


@dataclass(frozen=True)
class Target:
    """Where the destinations live and whether the load bounces them (``pinned_device_copies``)."""

    device: str
    pinned: bool

    def options(self, **kw) -> unickpt.LoadOptions:
        return unickpt.LoadOptions(io=ReadOptions(pinned_device_copies=self.pinned), **kw)


class Net(nn.Module):
    """Shapes chosen for the read engine's paths: ``big`` spans several 16 MiB pieces (not at a
    piece line), ``mid`` is read straight into its destination (>= 256 KiB), the rest are small
    tensors read with their neighbours."""

    def __init__(self, seed: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.big = nn.Parameter(torch.randn(1030, 4100, generator=g).to(dtype))  # ~16.9 MB fp32
        self.mid = nn.Parameter(torch.randn(520, 300, generator=g).to(torch.bfloat16))
        self.bias = nn.Parameter(torch.randn(7, generator=g).to(dtype))
        self.register_buffer("count", torch.arange(5, dtype=torch.int64) + seed)


def _bits(t: torch.Tensor) -> bytes:
    """A tensor's exact bytes (bit-exact comparison, NaN payloads and -0.0 included)."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _trained(device: str, seed: int, dtype: torch.dtype = torch.float32) -> tuple[Net, torch.optim.Optimizer]:
    net = Net(seed, dtype).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.5 + seed)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return net, opt


def _expected(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}
    for i, p in enumerate(net.parameters()):
        for k, v in opt.state[p].items():
            if torch.is_tensor(v):
                out[f"optim.{i}.{k}"] = v.detach().to("cpu", copy=True)
    return out


@pytest.fixture
def bounced(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(bounced, unpooled)`` bytes of every ``DeviceCopies`` a load finished (none on CPU)."""
    seen: list[tuple[int, int]] = []
    finish = device_mod.DeviceCopies.finish

    def spy(self: device_mod.DeviceCopies) -> None:
        seen.append((self.bounced, self.unpooled))
        finish(self)

    monkeypatch.setattr(device_mod.DeviceCopies, "finish", spy)
    return seen


@pytest.fixture(params=DEVICES)
def target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Target:
    """The destinations' device and option; ``cpu-bounced``: CPU, through the device path."""
    if request.param == "cuda-blocking":
        return Target("cuda", False)
    if request.param != "cpu-bounced":
        return Target(request.param, True)

    def simulated(cls, tensors, readers, slot_bytes, backlog, copied):
        return cls([], 2, slot_bytes, pin=False, copied=copied)

    monkeypatch.setattr(device_mod.DeviceCopies, "for_items", classmethod(simulated))
    return Target("cpu", True)


def test_same_layout_load_is_bit_exact_and_ordered_on_the_callers_stream(
    bounced: list[tuple[int, int]], target: Target, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    device = target.device
    src_net, src_opt = _trained("cpu", seed=1)
    want = _expected(src_net, src_opt)
    path = str(tmp_path / "ck")
    unickpt.save(path, {"model": src_net, "optimizer": src_opt})
    net, opt = _trained(device, seed=2)  # other values everywhere, optimizer state present
    stream = torch.cuda.Stream() if device == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if stream is not None:  # work still queued on the destinations: the load must land after it
            torch.cuda._sleep(50_000_000)
            with torch.no_grad():
                for p in net.parameters():
                    p.fill_(7.0)
        unickpt.load(path, {"model": net, "optimizer": opt}, options=target.options())
        got = _expected(net, opt)  # copies queued on the caller's stream, right after the load
    assert sorted(got) == sorted(want)
    for key in want:
        assert _bits(got[key]) == _bits(want[key]), key
    if request.node.callspec.params["target"] in ("cpu", "cuda-blocking"):
        assert bounced == []  # the plain CPU path and the blocking copies make no device copies
    else:
        big = want["model.big"].numel() * 4
        assert sum(b + u for b, u in bounced) >= 3 * big  # the weight and both Adam moments bounced


def test_cast_load_is_bit_exact(target: Target, tmp_path: Path) -> None:
    device = target.device
    src_net, _ = _trained("cpu", seed=3)
    path = str(tmp_path / "ck")
    unickpt.save(path, {"model": src_net})
    want = {k: v.to(torch.bfloat16) if v.dtype == torch.float32 else v for k, v in src_net.state_dict().items()}
    net = Net(4, torch.bfloat16).to(device)
    unickpt.load(path, {"model": net}, options=target.options(restore=RestoreOptions(cast_dtypes=True)))
    got = net.state_dict()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and _bits(got[key]) == _bits(value), key


@pytest.mark.parametrize(
    ("offsets", "lengths", "dtype"),
    [
        ((100, 0), (900, 4100), torch.float32),  # whole rows: one contiguous region, bounced
        ((30, 1000), (970, 2500), torch.float32),  # rows x columns: copied into place on the device
        ((0, 7), (1030, 4000), torch.bfloat16),  # columns, cast while copying
    ],
)
def test_partial_boxes_are_bit_exact(target: Target, offsets, lengths, dtype, tmp_path: Path) -> None:
    """The reads of a resharding load (a box of a saved tensor into a destination of the box's
    shape), through the read stage itself."""
    src_net, _ = _trained("cpu", seed=5)
    path = tmp_path / "ck"
    unickpt.save(str(path), {"model": src_net})
    full = src_net.big.detach().clone()
    box = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
    want = full[box].to(dtype)
    md = decode_metadata((path / METADATA_FILE).read_bytes())
    spec = ShardSpec("model.big", md.tensors["model.big"].dtype, tuple(full.shape), offsets, lengths)
    dest = torch.zeros(lengths, dtype=dtype, device=target.device)
    reads = plan_local_load(md, [spec], ShardIndex(md))
    read_stage(
        md,
        open_storage(str(path)),
        SingleProcessCoordinator(),
        [LoadItem(spec, dest)],
        reads,
        4,
        True,
        False,
        pinned_device_copies=target.pinned,
    )
    assert _bits(dest) == _bits(want)


def test_a_flipped_byte_raises_the_same_error_on_the_device_path(target: Target, tmp_path: Path) -> None:
    device = target.device
    src_net, _ = _trained("cpu", seed=6)
    path = tmp_path / "ck"
    unickpt.save(str(path), {"model": src_net})
    md = decode_metadata((path / METADATA_FILE).read_bytes())
    shard = md.tensors["model.big"].shards[0]
    data_file = path / md.files[shard.file_index]
    raw = bytearray(data_file.read_bytes())
    raw[shard.byte_offset + shard.byte_length - 3] ^= 0x10  # in the last piece of the bounced weight
    data_file.write_bytes(bytes(raw))
    net = Net(7).to(device)
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch"):
        unickpt.load(str(path), {"model": net}, options=target.options())
    staged = Net(8).to(device)
    before = _bits(staged.big)
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch"):
        unickpt.load(str(path), {"model": staged}, options=target.options(stage_before_apply=True))
    assert _bits(staged.big) == before  # staged: the live tensor untouched


def test_the_device_path_is_off_unless_asked_for(
    bounced: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``ReadOptions.pinned_device_copies`` defaults to off: with the device path wired for CPU
    destinations (as ``cpu-bounced``), a load with default options makes no device copies."""

    def simulated(cls, tensors, readers, slot_bytes, backlog, copied):
        return cls([], 2, slot_bytes, pin=False, copied=copied)

    monkeypatch.setattr(device_mod.DeviceCopies, "for_items", classmethod(simulated))
    src_net, _ = _trained("cpu", seed=9)
    path = str(tmp_path / "ck")
    unickpt.save(path, {"model": src_net})
    net = Net(10)
    unickpt.load(path, {"model": net})
    assert bounced == []
    assert _bits(net.big) == _bits(src_net.big)
    unickpt.load(path, {"model": Net(11)}, options=Target("cpu", True).options())
    assert bounced and bounced[0][0] + bounced[0][1] > 0
