"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/frameworks/test_fsdp_internals.py``, which holds its single-process tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.unit.frameworks.test_fsdp_internals import Net
from tests.workers.harness import run_ranks
from unickpt.frameworks import _fsdp_internals as internals
from unickpt.frameworks.module_state import clean_fqn

_CPU = torch.device("cpu")


def _build(use_orig_params: bool) -> tuple[nn.Module, nn.Module]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    net = Net()
    net.inner = FSDP(net.inner, use_orig_params=use_orig_params, device_id=_CPU)  # type: ignore[assignment]
    return ref, FSDP(net, use_orig_params=use_orig_params, device_id=_CPU)


def _fsdp1_report(rank: int, ws: int, use_orig_params: bool) -> dict:
    """Everything the accessors return on this rank, checked against the unwrapped model."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    ref, model = _build(use_orig_params)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    out: dict = {"units": {}, "problems": []}
    bad = out["problems"].append
    for name, mod in model.named_modules():
        if not isinstance(mod, FSDP):
            continue
        fp = internals.flat_param_of(mod)
        if fp is None:
            bad(f"{name}: no flat parameter")
            continue
        if internals.handle_of(mod) is None or not internals.is_flat_param(fp):
            bad(f"{name}: handle / _is_flat_param")
        sharded = internals.sharded_numel(fp)
        if fp.numel() != sharded:
            bad(f"{name}: flat numel {fp.numel()} != sharded {sharded}")
        fqns, shapes, runs = internals.orig_fqns(fp), internals.orig_shapes(fp), internals.shard_runs(fp)
        if not (len(fqns) == len(shapes) == len(runs)):
            bad(f"{name}: lengths {len(fqns)}, {len(shapes)}, {len(runs)}")
        prefix = name.replace("_fsdp_wrapped_module.", "")
        held = {}
        for rel, shape, run in zip(fqns, shapes, runs):
            full = f"{prefix}.{rel}" if prefix else rel
            want = ref_params[full].detach()
            if shape != tuple(want.shape):
                bad(f"{full}: shape {shape} != {tuple(want.shape)}")
            if not isinstance(run, internals.ShardRun):
                bad(f"{full}: run type {type(run)}")
            if run.in_shard:
                a, n, s = run.offset_in_shard, run.numel_in_shard, run.intra_param_start_idx
                if not (0 <= a and a + n <= sharded and s + n <= want.numel()):
                    bad(f"{full}: run {run} outside shard {sharded} / param {want.numel()}")
                if not torch.equal(fp.detach()[a : a + n], want.reshape(-1)[s : s + n]):
                    bad(f"{full}: local flat slice is not the parameter's elements {s}..{s + n}")
                held[full] = (s, n)
            else:
                held[full] = (0, 0)
        out["units"][prefix or "<root>"] = {
            "fqns": sorted(f"{prefix}.{f}" if prefix else f for f in fqns),
            "held": held,
            "aliases": [list(a) for a in internals.shared_aliases(fp)],
            "orig_params": None if internals.orig_params(fp) is None else len(internals.orig_params(fp) or ()),
            "shared_params": len(internals.shared_params(fp)),
            "sharded": sharded,
            # FSDP1 flat-parameter attributes an independent oracle may read
            "numels_with_padding": [int(n) for n in fp._numels_with_padding],  # type: ignore[attr-defined]
            "is_padding_mask": [bool(m) for m in fp._is_padding_mask],  # type: ignore[attr-defined]
        }
        origs = internals.orig_params(fp)
        if origs is not None and any(internals.is_flat_param(p) for p in origs):
            bad(f"{name}: an original parameter reads as a flat parameter")
    out["buffers"] = sorted(n for n, _ in internals.persistent_buffers(model))
    # the wrapper segments FSDP1 inserts are the ones clean_fqn drops (use_orig_params=True
    # keeps the original parameters visible under their wrapped names)
    out["clean_params"] = sorted(clean_fqn(n, True) for n, _ in model.named_parameters())
    out["ref_params"] = sorted(n for n, _ in ref.named_parameters())
    out["world"] = dist.get_world_size()
    return out


def _probe_all(rank: int, ws: int) -> dict:
    """Every report of this file from one spawn of 2 ranks."""
    flat, orig = _fsdp1_report(rank, ws, False), _fsdp1_report(rank, ws, True)
    return {"flat": flat, "orig": orig, "boxes": _fsdp2_boxes(rank, ws)}


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks(_probe_all, 2, timeout=240)


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_fsdp1_private_accessors_match_the_unwrapped_model(reports, use_orig_params):
    res = [r["orig" if use_orig_params else "flat"] for r in reports]
    for rank, r in enumerate(res):
        assert r["problems"] == [], (rank, r["problems"])
        assert set(r["units"]) == {"<root>", "inner"}, r["units"].keys()
        root, inner = r["units"]["<root>"], r["units"]["inner"]
        # the tied head.weight is no original parameter of its own: an alias of embed.weight
        assert root["fqns"] == ["embed.weight", "scale"] and inner["fqns"] == ["inner.fc.bias", "inner.fc.weight"]
        assert root["aliases"] == [["embed.weight", "head.weight"]]
        assert inner["aliases"] == []
        n_orig = None if not use_orig_params else 2
        assert root["orig_params"] == n_orig and inner["orig_params"] == n_orig
        assert root["shared_params"] == (1 if use_orig_params else 0) and inner["shared_params"] == 0
        for unit in (root, inner):
            numels, mask = unit["numels_with_padding"], unit["is_padding_mask"]
            assert len(numels) == len(mask) and sum(not m for m in mask) == 2
            assert 0 <= unit["sharded"] * 2 - sum(numels) < 2  # right padding: less than one per rank
        assert r["buffers"] == ["_fsdp_wrapped_module.inner._fsdp_wrapped_module.count"]
        if use_orig_params:
            assert r["clean_params"] == r["ref_params"], r["clean_params"]
    # the ranks' runs tile every original parameter exactly once
    sizes = {"embed.weight": 21, "scale": 1, "inner.fc.weight": 15, "inner.fc.bias": 3}
    for unit in ("<root>", "inner"):
        runs: dict[str, list] = {}
        for r in res:
            for fqn, (s, n) in r["units"][unit]["held"].items():
                if n:
                    runs.setdefault(fqn, []).append((s, n))
        for fqn, rs in runs.items():
            pos = 0
            for s, n in sorted(rs):
                assert s == pos, (fqn, rs)
                pos += n
            assert pos == sizes[fqn], (fqn, rs)


def _fsdp2_boxes(rank: int, ws: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    sharded = nn.Linear(5, 3)  # weight (3, 5): Shard(0) over 2 ranks, uneven: 2 rows + 1 row
    fully_shard(sharded)
    tp = nn.Sequential(nn.Linear(4, 6))
    parallelize_module(tp, init_device_mesh("cpu", (ws,)), {"0": ColwiseParallel()})
    return {
        "fsdp2_weight": internals.dtensor_local_box(sharded.weight),
        "fsdp2_bias": internals.dtensor_local_box(sharded.bias),
        "tp_weight": internals.dtensor_local_box(tp[0].weight),
        "local_is_to_local": [
            _geometry(internals.dtensor_local(t)) == _geometry(t.to_local())
            for t in (sharded.weight, sharded.bias, tp[0].weight)
        ],
    }


def _geometry(t: torch.Tensor) -> tuple:
    return (
        t.data_ptr(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        type(t) is torch.Tensor or isinstance(t, nn.Parameter),
    )


def test_dtensor_local_box_of_fsdp2_and_tp_shards(reports):
    res = [r["boxes"] for r in reports]
    # torch.chunk semantics: 3 rows over 2 ranks -> 2 + 1; 6 rows -> 3 + 3
    assert res[0]["fsdp2_weight"] == ((0, 0), (2, 5)) and res[1]["fsdp2_weight"] == ((2, 0), (1, 5))
    assert res[0]["fsdp2_bias"] == ((0,), (2,)) and res[1]["fsdp2_bias"] == ((2,), (1,))
    assert res[0]["tp_weight"] == ((0, 0), (3, 4)) and res[1]["tp_weight"] == ((3, 0), (3, 4))
    assert all(all(r["local_is_to_local"]) for r in res)  # DTensor._local_tensor is to_local()'s memory
