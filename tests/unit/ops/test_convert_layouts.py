"""Issue 26 item 3: ``unickpt convert`` keeps the optimizer's hyper-parameters in every common DCP
layout, both ways.

Every source checkpoint is written by DCP itself (``dcp.save`` in one process), laid out as the
framework lays it out. The layouts, from the frameworks' sources (read, not copied):

* ``get_state_dict(model, optim)`` (torch, installed): ``{"state": {fqn: {...}}, "param_groups":
  [{..., "params": [fqn, ...]}]}`` under whatever names the user picks.
* torchtitan (pytorch/torchtitan ``components/checkpointer/dcp.py``,
  ``CheckpointManager._flattened_model_states_sd``): the model's FQNs at the top level beside
  ``optimizer`` (``components/optimizer/optimizer.py`` ``OptimizersContainer.state_dict`` ->
  ``utils.get_flat_optim_state_dict``: ``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyper>``, the
  keys of torch's ``flatten_optimizer_state_dict=True``, used here), ``lr_scheduler``
  (``LRSchedulersContainer.state_dict``: ``{"last_epoch"}``), ``train_state`` (``Trainer.state_dict``:
  ``{"step", "ntokens_seen"}``) and ``dataloader`` (``components/data/loader.py``: ``{"version",
  "dp_world_size", "dp_rank_<r>"}``). Its resume: ``dcp.load`` of the same names from the live
  objects (no partial load), then ``set_model_state_dict`` / ``OptimizersContainer.load_state_dict``.
* Lightning (``src/lightning/pytorch/strategies/fsdp.py``, ``FSDPStrategy.save_checkpoint`` with
  ``state_dict_type="sharded"``): ``{"model": checkpoint["state_dict"], "optimizer_<i>":
  FSDP.optim_state_dict(...)}`` by DCP, the rest of the checkpoint dict ``torch.save``-d to
  ``meta.pt`` by rank 0.
* Accelerate (``src/accelerate/utils/fsdp_utils.py``, ``save_fsdp_model`` / ``save_fsdp_optimizer``
  with ``SHARDED_STATE_DICT``): DCP folders ``pytorch_model_fsdp_<i>/`` (``{"model": ...}``) and
  ``optimizer_<i>/`` (``{"optimizer": ...}``), next to pickled ``scheduler.bin`` / ``random_states_0.pkl``.
``FSDP.optim_state_dict`` (Lightning, Accelerate with FSDP1) keys state and ``params`` by FQN like
``get_state_dict``, which stands in for it here (it needs no process group).

The model is an ``nn.Sequential`` (FQNs ``0.weight``: a digit where DCP puts param group indices),
trained a few real steps by an AdamW with two param groups whose lr, betas, eps and weight decay
all differ from the defaults. Expected values come from that optimizer, never from the converter.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

import unickpt
from tests.support.hypothesis_profiles import examples
from unickpt.errors import UnsafePathError
from unickpt.ops.convert import from_dcp, to_dcp
from unickpt.ops.dcp_layouts import ImportedLoaderState

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
LOADER = {"version": 1, "dp_world_size": 1, "dp_rank_0": b"\x80\x04opaque iterator state"}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))


def _adamw(model: nn.Module, lr: float = 3e-3, betas=(0.8, 0.95), eps=1e-6, wd=0.05) -> torch.optim.AdamW:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW(
        [{"params": weights}, {"params": biases, "weight_decay": 0.0, "lr": lr / 3}], lr=lr, betas=betas, eps=eps,
        weight_decay=wd,
    )  # fmt: skip


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    optim.zero_grad()
    model(torch.randn(3, 5, generator=g)).square().sum().backward()
    optim.step()


def _trained(scheduler: bool = False) -> tuple[nn.Module, torch.optim.AdamW, Any]:
    model = _model(0)
    optim = _adamw(model)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s)) if scheduler else None
    for s in range(3):
        _step(model, optim, s)
        if sched is not None:
            sched.step()
    return model, optim, sched


def _fresh(scheduler: bool = False) -> tuple[nn.Module, torch.optim.AdamW]:
    """Another model and an AdamW at the defaults: only a load can give them the saved values."""
    model = _model(1)
    optim = _adamw(model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.01)
    if scheduler:  # torchtitan builds its LambdaLR before resuming: groups carry "initial_lr"
        torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    return model, optim


def _dcp_save(state: dict[str, Any], folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


def _dcp_load(state: dict[str, Any], folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)  # no allow_partial_load


def _assert_restored(model, optim, fresh, fresh_optim) -> None:
    """Weights, every hyper-parameter and every state tensor (step, both moments) bit-exact, and
    the next step identical."""
    for (k, v), (_, w) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert v.dtype == w.dtype and torch.equal(v, w), k
    assert len(optim.param_groups) == len(fresh_optim.param_groups)
    for g, h in zip(optim.param_groups, fresh_optim.param_groups):
        want = {k: v for k, v in g.items() if k != "params"}
        got = {k: v for k, v in h.items() if k != "params"}
        assert got == want
        assert type(h["betas"]) is tuple and h["lr"] == g["lr"] and h["weight_decay"] == g["weight_decay"]
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert set(optim.state[p]) == set(fresh_optim.state[q]) == {"step", "exp_avg", "exp_avg_sq"}
        for name, t in optim.state[p].items():
            u = fresh_optim.state[q][name]
            assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t), name
    _step(model, optim, 99)
    _step(fresh, fresh_optim, 99)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def _unickpt_load(ck: Path, scheduler: bool = False) -> tuple[nn.Module, torch.optim.AdamW]:
    fresh, fresh_optim = _fresh(scheduler)
    unickpt.load(str(ck), {"model": fresh, "optimizer": fresh_optim})  # strict: every key, every group
    return fresh, fresh_optim


# ------------------------------------------------------------------- get_state_dict, any names


@pytest.mark.parametrize(
    "names", [("model", "optimizer"), ("model", "optim"), ("module", "opt"), ("app.model", "app.optim")]
)
def test_get_state_dict_layout_round_trips_with_hyper_parameters(tmp_path, names):
    """DCP -> unickpt: a strict unickpt.load restores everything (today: MissingKeysError for
    ``optimizer`` and every name but ``optim``); unickpt -> DCP: DCP's own load + set_state_dict
    restores everything without allow_partial_load."""
    model, optim, _ = _trained()
    msd, osd = get_state_dict(model, optim)
    state: dict[str, Any] = {}
    for name, sd in zip(names, (msd, osd)):
        head, _, tail = name.rpartition(".")
        (state.setdefault(head, {}) if head else state)[tail] = sd  # "app.model": the DCP tutorial's AppState
    _dcp_save(state, tmp_path / "dcp")
    r = from_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"))
    _assert_restored(*_trained()[:2], *_unickpt_load(tmp_path / "ck"))
    assert not r.skipped, r.skipped

    to_dcp(str(tmp_path / "ck"), str(tmp_path / "back"))
    fresh, fresh_optim = _fresh()
    msd2, osd2 = get_state_dict(fresh, fresh_optim)
    sd = {"model": msd2, "optimizer": osd2}
    _dcp_load(sd, tmp_path / "back")
    set_state_dict(fresh, fresh_optim, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    _assert_restored(model, optim, fresh, fresh_optim)


def test_unickpt_checkpoint_exports_as_get_state_dict_lays_it_out(tmp_path):
    model, optim, _ = _trained()
    unickpt.save(str(tmp_path / "ck"), {"model": model, "optimizer": optim})
    to_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"))
    fresh, fresh_optim = _fresh()
    msd, osd = get_state_dict(fresh, fresh_optim)
    sd = {"model": msd, "optimizer": osd}
    _dcp_load(sd, tmp_path / "dcp")
    set_state_dict(fresh, fresh_optim, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    _assert_restored(model, optim, fresh, fresh_optim)


# ------------------------------------------------------------------- torchtitan


class _TitanOptimizers(Stateful):
    """torchtitan's OptimizersContainer, reduced to one optimizer: the flat, FQN-keyed state dict."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim, options=FLAT)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, sd, options=FLAT)


class _Plain(Stateful):
    """torchtitan's train state / lr schedulers / dataloader: a small dict of plain values."""

    def __init__(self, sd: dict[str, Any]) -> None:
        self.sd = sd

    def state_dict(self) -> dict[str, Any]:
        return dict(self.sd)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = dict(sd)


def _titan_states(model, optim, step: int, last_epoch: int, loader: dict[str, Any]) -> dict[str, Any]:
    """What torchtitan's checkpointer hands dcp.save / dcp.load: the model's FQNs at the top level."""
    return {
        **get_model_state_dict(model),
        "optimizer": _TitanOptimizers(model, optim),
        "lr_scheduler": _Plain({"last_epoch": last_epoch}),
        "train_state": _Plain({"step": step, "ntokens_seen": 15 * step}),
        "dataloader": _Plain(loader),
    }


def test_torchtitan_layout_round_trips_with_hyper_parameters_and_training_state(tmp_path):
    model, optim, sched = _trained(scheduler=True)
    assert sched.last_epoch == 3
    _dcp_save(_titan_states(model, optim, 3, 3, LOADER), tmp_path / "step-3")
    r = from_dcp(str(tmp_path / "step-3"), str(tmp_path / "ck"))
    fresh, fresh_optim = _fresh(scheduler=True)
    loader = ImportedLoaderState(None)
    state = {"model": fresh, "optimizer": fresh_optim, "extra_state": None, "dataloader": loader}
    unickpt.load(str(tmp_path / "ck"), state)  # strict
    assert not r.skipped, r.skipped
    assert "top level" in r.layout and "torchtitan" in r.layout, r.layout
    assert state["extra_state"] == {"lr_scheduler": {"last_epoch": 3}, "train_state": {"step": 3, "ntokens_seen": 45}}
    assert loader.state == LOADER
    model_b, optim_b, _ = _trained(scheduler=True)
    _assert_restored(model_b, optim_b, fresh, fresh_optim)

    to_dcp(str(tmp_path / "ck"), str(tmp_path / "back"), layout="torchtitan")
    fresh, fresh_optim = _fresh(scheduler=True)
    states = _titan_states(fresh, fresh_optim, 0, 0, {"version": 0, "dp_world_size": 0, "dp_rank_0": b""})
    _dcp_load(states, tmp_path / "back")  # as torchtitan's CheckpointManager.load: every name, no partial load
    set_model_state_dict(fresh, {k: v for k, v in states.items() if isinstance(v, torch.Tensor)})
    assert states["train_state"].sd == {"step": 3, "ntokens_seen": 45}
    assert states["lr_scheduler"].sd == {"last_epoch": 3} and states["dataloader"].sd == LOADER
    _assert_restored(model, optim, fresh, fresh_optim)


def test_unickpt_checkpoint_exports_as_torchtitan_resumes_it(tmp_path):
    model, optim, _ = _trained(scheduler=True)
    extra = {"train_state": {"step": 3, "ntokens_seen": 45}, "lr_scheduler": {"last_epoch": 3}}
    loader = ImportedLoaderState(dict(LOADER))
    unickpt.save(str(tmp_path / "ck"), {"model": model, "optimizer": optim, "extra_state": extra, "dataloader": loader})
    to_dcp(str(tmp_path / "ck"), str(tmp_path / "step-3"), layout="torchtitan")
    fresh, fresh_optim = _fresh(scheduler=True)
    states = _titan_states(fresh, fresh_optim, 0, 0, {"version": 0, "dp_world_size": 0, "dp_rank_0": b""})
    _dcp_load(states, tmp_path / "step-3")
    set_model_state_dict(fresh, {k: v for k, v in states.items() if isinstance(v, torch.Tensor)})
    assert states["train_state"].sd == extra["train_state"] and states["dataloader"].sd == LOADER
    _assert_restored(model, optim, fresh, fresh_optim)


@pytest.mark.parametrize("layout", ["state_dict", "torchtitan"])
def test_optimizer_built_from_named_parameters_exports_in_both_layouts(tmp_path, layout):
    """Param groups of an optimizer built from ``named_parameters()`` carry ``param_names``, which
    torch's own (flattened) optimizer state dict asks for: the export writes it."""
    model = _model(0)
    optim = torch.optim.AdamW(model.named_parameters(), lr=0.02, betas=(0.7, 0.9), weight_decay=0.3)
    for s in range(2):
        _step(model, optim, s)
    unickpt.save(str(tmp_path / "ck"), {"model": model, "optimizer": optim})
    to_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"), layout=layout)
    fresh = _model(1)
    fresh_optim = torch.optim.AdamW(fresh.named_parameters())
    if layout == "torchtitan":
        sd = {**get_model_state_dict(fresh), "optimizer": _TitanOptimizers(fresh, fresh_optim)}
        _dcp_load(sd, tmp_path / "dcp")
        set_model_state_dict(fresh, {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)})
    else:
        msd, osd = get_state_dict(fresh, fresh_optim)
        sd = {"model": msd, "optimizer": osd}
        _dcp_load(sd, tmp_path / "dcp")
        set_state_dict(fresh, fresh_optim, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    assert fresh_optim.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]
    _assert_restored(model, optim, fresh, fresh_optim)


# ------------------------------------------------------------------- Lightning and Accelerate


def test_lightning_sharded_fsdp_layout_imports_with_hyper_parameters(tmp_path):
    model, optim, _ = _trained()
    msd, osd = get_state_dict(model, optim)
    folder = tmp_path / "epoch=0-step=3.ckpt"
    _dcp_save({"model": msd, "optimizer_0": osd}, folder)
    torch.save({"epoch": 0, "global_step": 3, "pytorch-lightning_version": "2.5.0", "lr_schedulers": []},
               folder / "meta.pt")  # fmt: skip
    r = from_dcp(str(folder), str(tmp_path / "ck"))
    _assert_restored(*_trained()[:2], *_unickpt_load(tmp_path / "ck"))
    assert len(r.skipped) == 1 and r.skipped[0].startswith("meta.pt"), r.skipped


def test_accelerate_sharded_fsdp_layout_imports_with_hyper_parameters(tmp_path):
    model, optim, _ = _trained()
    msd, osd = get_state_dict(model, optim)
    root = tmp_path / "checkpoint_3"
    _dcp_save({"model": msd}, root / "pytorch_model_fsdp_0")
    _dcp_save({"optimizer": osd}, root / "optimizer_0")
    for name in ("scheduler.bin", "random_states_0.pkl"):
        torch.save({}, root / name)
    r = from_dcp(str(root), str(tmp_path / "ck"))
    _assert_restored(*_trained()[:2], *_unickpt_load(tmp_path / "ck"))
    assert sorted(s.split()[0] for s in r.skipped) == ["random_states_0.pkl", "scheduler.bin"], r.skipped


def test_a_linked_sub_folder_is_refused(tmp_path):
    """A folder of DCP checkpoints whose ``optimizer_0`` is a link to another folder: refused, not read
    (a part of the layout is never read through a link); a link that is no part of it is listed."""
    model, optim, _ = _trained()
    msd, osd = get_state_dict(model, optim)
    _dcp_save({"model": msd}, tmp_path / "root" / "pytorch_model_fsdp_0")
    _dcp_save({"optimizer": osd}, tmp_path / "elsewhere")
    (tmp_path / "root" / "notes").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    r = from_dcp(str(tmp_path / "root"), str(tmp_path / "ck"))
    assert r.skipped == ("notes (a link: not followed)",)
    fresh = _model(1)
    unickpt.load(str(tmp_path / "ck"), {"model": fresh})  # strict: the checkpoint holds the model only
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    (tmp_path / "root" / "optimizer_0").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(UnsafePathError, match="optimizer_0 is a symbolic link"):
        from_dcp(str(tmp_path / "root"), str(tmp_path / "ck2"))
    assert not (tmp_path / "ck2").exists()


def test_cli_layout_flag(tmp_path, capsys):
    from unickpt.cli import main

    model, optim, _ = _trained(scheduler=True)
    unickpt.save(str(tmp_path / "ck"), {"model": model, "optimizer": optim})
    assert main(["convert", "--from", "dcp", "--layout", "torchtitan", str(tmp_path / "ck"), str(tmp_path / "x")]) == 2
    assert "--layout applies to --to dcp" in capsys.readouterr().err
    assert main(["convert", "--to", "dcp", "--layout", "torchtitan", str(tmp_path / "ck"), str(tmp_path / "out")]) == 0
    assert "(torchtitan)" in capsys.readouterr().out
    r = from_dcp(str(tmp_path / "out"), str(tmp_path / "ck2"))
    assert "torchtitan" in r.layout
    _assert_restored(model, optim, *_unickpt_load(tmp_path / "ck2", scheduler=True))


# ------------------------------------------------------------------- the mapping rule, property-tested

_SEGMENTS = st.sampled_from(["0", "1", "12", "layers", "state", "attn", "w"])
_LEAVES = st.sampled_from(["weight", "bias", "0", "scale"])
_NAMES = [("model", "optimizer"), ("model", "optim"), ("module", "opt"), ("app.model", "app.optim"),
          ("model", "optimizer_0")]  # fmt: skip


def _no_nesting(fqns: list[str]) -> bool:
    """No parameter is a module of another (``a`` and ``a.b`` cannot both be parameters)."""
    return not any(g.startswith(f + ".") for f in fqns for g in fqns)


@st.composite
def _optimizer_cases(draw: Any) -> dict[str, Any]:
    """A model's FQNs (numeric and ``state`` segments included), a partition into param groups
    with distinct hyper-parameters, per-parameter state (tensors and plain values), and a layout."""
    paths = st.lists(_SEGMENTS, max_size=3).map(".".join)
    fqns = draw(
        st.lists(st.tuples(paths, _LEAVES).map(lambda t: f"{t[0]}.{t[1]}".lstrip(".")), min_size=2, max_size=7,
                 unique=True).filter(_no_nesting)
    )  # fmt: skip
    trained = fqns[1:]  # fqns[0]: a tensor of the model no optimizer updates
    labels = draw(st.lists(st.integers(0, 2), min_size=len(trained), max_size=len(trained)))
    order = list(dict.fromkeys(labels))
    groups: list[dict[str, Any]] = []
    for gi, label in enumerate(order):
        groups.append({
            "lr": (gi + 1) / 1000, "betas": (draw(st.floats(0, 1)), 0.999), "weight_decay": draw(st.floats(0, 1)),
            "amsgrad": draw(st.booleans()), "foreach": None,
            "params": [f for f, lab in zip(trained, labels) if lab == label],
        })  # fmt: skip
    counter = iter(range(1 << 20))
    state: dict[str, dict[str, Any]] = {}
    for f in trained:
        names = draw(st.sets(st.sampled_from(["step", "exp_avg", "momentum_buffer"])))
        plain_step = draw(st.booleans())
        st_f = {}
        for n in sorted(names):
            if n == "momentum_buffer":
                st_f[n] = None
            elif n == "step" and plain_step:
                st_f[n] = float(next(counter))
            else:
                st_f[n] = torch.tensor([float(next(counter))])
        if st_f:
            state[f] = st_f
    model = {f: torch.tensor([-1.0 - i]) for i, f in enumerate(fqns)}
    return {"model": model, "groups": groups, "state": state, "layout": draw(st.sampled_from([*_NAMES, "titan"]))}


def _split(flat: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}, {
        k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)
    }


def _nest(name: str, value: Any) -> dict[str, Any]:
    head, _, tail = name.partition(".")
    return {head: _nest(tail, value) if tail else value}


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if k in out and isinstance(v, dict) else v
    return out


@settings(max_examples=examples(80), deadline=None)
@given(_optimizer_cases())
def test_every_layout_maps_onto_unickpt_keys_and_back(case):
    """For any FQNs (digits and ``state`` segments where DCP puts indices and state), param groups
    and state: the model, every state entry and every param group come out under unickpt's keys,
    and exporting them (both layouts) then importing again gives the same."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # what dcp.save flattens with

    from unickpt.ops.dcp_layouts import SavedUnickpt, export_state, map_import

    model, groups, state = case["model"], case["groups"], case["state"]
    if case["layout"] == "titan":  # torchtitan: FQNs at the top level, the optimizer flattened by FQN
        flat_optim = {f"state.{f}.{n}": v for f, s in state.items() for n, v in s.items()}
        flat_optim |= {
            f"param_groups.{f}.{k}": v for g in groups for f in g["params"] for k, v in g.items() if k != "params"
        }
        sd = {**model, "optimizer": flat_optim, "train_state": {"step": 3}}
    else:
        m, o = case["layout"]
        sd = _merge(_nest(m, model), _nest(o, {"state": state, "param_groups": groups}))
    want_tensors = {f"model.{f}": t for f, t in model.items()}
    want_tensors |= {
        f"optimizer.state.{f}.{n}": v
        for f, s in state.items()
        for n, v in s.items()
        if v is not None and not isinstance(v, float)
    }
    want_values = {f: {n: v for n, v in s.items() if v is None or isinstance(v, float)} for f, s in state.items()}
    want_values = {f: v for f, v in want_values.items() if v}

    def check(imported):
        assert imported.skipped == ()
        assert imported.tensors.keys() == want_tensors.keys()
        assert all(imported.tensors[k] is t for k, t in want_tensors.items())
        assert imported.objects["optimizer"] == {"param_groups": groups, "state_values": want_values}

    imported = map_import(*_split(flatten_state_dict(sd)[0]))
    check(imported)
    saved = SavedUnickpt(imported.tensors, imported.objects["optimizer"], imported.extra_state, None, ())
    for layout in ("state_dict", "torchtitan"):
        out, _ = export_state(saved, layout)
        check(map_import(*_split(flatten_state_dict(out)[0])))
