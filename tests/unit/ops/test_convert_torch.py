"""Issue 39, item 12: ``unickpt convert --from torch`` / ``--from lightning`` import a ``torch.save``
file and a Lightning ``.ckpt`` (model, optimizer with its param groups and state by parameter
name, schedulers, loops and every plain value), read without running the file's pickle.

Every source file is written by torch (``torch.save`` of real ``state_dict()``s after real
training steps) or by a real ``lightning.Trainer`` (one process, CPU). Expected values come from
the live objects that were saved (or from ``torch.load(weights_only=True)`` of the same file),
never from the converter. The resume is the documented snippet (docs/migrating.md): fresh objects
built as the training script builds them, ``unickpt.load(out, {...})``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from unickpt.cli import main
from unickpt.errors import CheckpointError, ConfigurationError, CorruptMetadataError, NotACheckpointError
from unickpt.ops import convert


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any = None, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        model(torch.randn(5, 4, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _assert_same_optimizer(expected: torch.optim.Optimizer, got: torch.optim.Optimizer) -> None:
    a, b = expected.state_dict(), got.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, st in a["state"].items():
        assert st.keys() == b["state"][i].keys(), i
        for k, v in st.items():
            assert torch.equal(v, b["state"][i][k]) and v.dtype == b["state"][i][k].dtype, (i, k)


def _assert_same_model(expected: nn.Module, got: nn.Module) -> None:
    a, b = expected.state_dict(), got.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype, k


def test_issue39_item12_torch_save_resumes_bit_exact(tmp_path) -> None:
    """The common case: ``{"model", "optimizer", "lr_scheduler", "epoch"}`` (a BatchNorm in the
    model: its buffers are no parameters of the optimizer). After conversion, the resume snippet
    gives the saved parameters, optimizer state and scheduler bit for bit, and the next step equals
    the uninterrupted run's."""
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _train(model, opt, sched)
    src = tmp_path / "ckpt.pt"
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict(), "epoch": 3},
        src,
    )
    out = str(tmp_path / "out")
    result = convert.from_torch(str(src), out)
    assert "inferred from the model's order" in result.layout

    model2 = _model(1)  # other weights: they must come from the checkpoint
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    state = {"model": model2, "optimizer": opt2, "lr_scheduler": sched2, "extra_state": None}
    unickpt.load(out, state)
    _assert_same_model(model, model2)
    _assert_same_optimizer(opt, opt2)
    assert sched2.state_dict() == sched.state_dict()
    assert state["extra_state"] == {"epoch": 3}

    _train(model, opt, sched, steps=2)
    _train(model2, opt2, sched2, steps=2)
    _assert_same_model(model, model2)


def test_issue39_item12_names_in_the_file_need_no_inference(tmp_path) -> None:
    """Optimizer state keyed by name (``get_optimizer_state_dict`` with a full state dict, as
    FSDP and a Lightning FSDP full checkpoint write it) and an optimizer built over
    ``named_parameters()`` (groups carry ``param_names``), both with two param groups, load exactly."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    for kind in ("fqn", "param_names"):
        model = _model(0)
        named = list(model.named_parameters())
        if kind == "fqn":
            groups: list[dict[str, Any]] = [
                {"params": [p for n, p in named if n.endswith("weight")], "lr": 0.02},
                {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.03, "weight_decay": 0.0},
            ]
        else:
            groups = [
                {"params": [(n, p) for n, p in named if n.endswith("weight")], "lr": 0.02},
                {"params": [(n, p) for n, p in named if n.endswith("bias")], "lr": 0.03, "weight_decay": 0.0},
            ]
        opt = torch.optim.AdamW(groups)
        _train(model, opt)
        osd = (
            get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
            if kind == "fqn"
            else opt.state_dict()
        )
        if kind == "fqn":
            assert isinstance(next(iter(osd["state"])), str)
        src = tmp_path / f"{kind}.pt"
        torch.save({"model": model.state_dict(), "optim": osd}, src)
        out = str(tmp_path / f"out-{kind}")
        result = convert.from_torch(str(src), out)
        assert ("named in the file" if kind == "fqn" else "param_names") in result.layout

        model2 = _model(1)
        named2 = list(model2.named_parameters())
        if kind == "fqn":
            groups2: list[dict[str, Any]] = [
                {"params": [p for n, p in named2 if n.endswith("weight")]},
                {"params": [p for n, p in named2 if n.endswith("bias")]},
            ]
        else:
            groups2 = [
                {"params": [(n, p) for n, p in named2 if n.endswith("weight")]},
                {"params": [(n, p) for n, p in named2 if n.endswith("bias")]},
            ]
        opt2 = torch.optim.AdamW(groups2, lr=0.5)
        unickpt.load(out, {"model": model2, "optimizer": opt2})
        _assert_same_model(model, model2)
        _assert_same_optimizer(opt, opt2)


def test_issue39_item12_numbered_groups_need_param_names(tmp_path) -> None:
    """Torch numbers a state dict's parameters; with two param groups (weights with decay, biases
    without, the usual AdamW set-up) the numbers follow the groups, not the model: mapping them by
    the model's order would give the weights' moments to the biases. Refused with a message saying
    what to pass; with ``param_names_of(model, optimizer)`` (or ``--param-names FILE``) exact."""
    model = _model(0)
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight")]
    no_decay = [p for n, p in named if n.endswith("bias")]

    def make(m: nn.Module) -> torch.optim.Optimizer:
        ps = list(m.named_parameters())
        return torch.optim.AdamW(
            [
                {"params": [p for n, p in ps if n.endswith("weight")], "weight_decay": 0.1},
                {"params": [p for n, p in ps if n.endswith("bias")], "weight_decay": 0.0},
            ],
            lr=0.01,
        )

    opt = make(model)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in decay]
    assert [id(p) for p in opt.param_groups[1]["params"]] == [id(p) for p in no_decay]
    _train(model, opt)
    src = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)

    with pytest.raises(ConfigurationError, match="2 param groups.*--param-names"):
        convert.from_torch(str(src), str(tmp_path / "refused"))
    assert not os.path.exists(tmp_path / "refused")

    fresh = _model(1)
    names = convert.param_names_of(fresh, make(fresh))
    assert names == ["0.weight", "1.weight", "3.weight", "0.bias", "1.bias", "3.bias"]
    out = str(tmp_path / "out")
    convert.from_torch(str(src), out, param_names=names)
    model2 = _model(1)
    opt2 = make(model2)
    unickpt.load(out, {"model": model2, "optimizer": opt2})
    _assert_same_model(model, model2)
    _assert_same_optimizer(opt, opt2)

    # the command line: the same names from a file
    (tmp_path / "names.txt").write_text("\n".join(names) + "\n")
    cli_out = str(tmp_path / "cli")
    args = ["convert", "--from", "torch", str(src), cli_out, "--param-names", str(tmp_path / "names.txt")]
    assert main(args) == 0
    model3 = _model(2)
    opt3 = make(model3)
    unickpt.load(cli_out, {"model": model3, "optimizer": opt3})
    _assert_same_optimizer(opt, opt3)


def test_issue39_item12_optimizer_over_a_subset_is_refused(tmp_path) -> None:
    """An optimizer over the trainable parameters only (a frozen first layer): its numbers cannot
    be placed from the file: refused naming the counts, never mapped by position."""
    model = _model(0)
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    _train(model, opt)
    src = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    with pytest.raises(ConfigurationError, match="updates 4 parameters, the model state dict has 6"):
        convert.from_torch(str(src), str(tmp_path / "out"))


def test_issue39_item12_ddp_names_ema_module_and_plain_values(tmp_path) -> None:
    """A DDP-wrapped model's ``module.`` names load into the bare module (as unickpt names modules);
    a second state dict (an EMA) becomes a module under its own key; a GradScaler-like dict a
    Stateful; a bare ``torch.save(model.state_dict())`` is the model."""
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt)
    ema = _model(3)
    ddp_sd = {f"module.{k}": v for k, v in model.state_dict().items()}
    scaler = {"scale": 1024.0, "growth_factor": 2.0, "_growth_tracker": 5}
    src = tmp_path / "ckpt.pt"
    torch.save(
        {"model": ddp_sd, "ema": ema.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler, "step": 9}, src
    )
    out = str(tmp_path / "out")
    convert.from_torch(str(src), out)

    class Holder:
        value: Any = None

        def state_dict(self) -> Any:
            return self.value

        def load_state_dict(self, value: Any) -> None:
            self.value = value

    model2, ema2, holder = _model(1), _model(4), Holder()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    state = {"model": model2, "ema": ema2, "optimizer": opt2, "scaler": holder, "extra_state": None}
    unickpt.load(out, state)
    _assert_same_model(model, model2)
    _assert_same_model(ema, ema2)
    _assert_same_optimizer(opt, opt2)
    assert holder.value == scaler
    assert state["extra_state"] == {"step": 9}

    bare = tmp_path / "bare.pt"
    torch.save(model.state_dict(), bare)
    convert.from_torch(str(bare), str(tmp_path / "bare"))
    model3 = _model(5)
    unickpt.load(str(tmp_path / "bare"), {"model": model3})
    _assert_same_model(model, model3)


def test_issue39_item12_runs_no_code_from_the_file(tmp_path) -> None:
    """A file whose pickle would call ``os.system`` (or build any class that is no tensor or plain
    value): refused before anything runs, with a message saying what to re-save."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    src = tmp_path / "evil.pt"
    torch.save({"model": _model(0).state_dict(), "args": Evil()}, src)
    with pytest.raises(CorruptMetadataError, match="posix.system|os.system|nt.system") as info:
        convert.from_torch(str(src), str(tmp_path / "out"))
    assert "vars(args)" in str(info.value)
    assert not marker.exists()


def test_issue39_item12_not_a_file(tmp_path) -> None:
    (tmp_path / "folder").mkdir()  # a folder where a file belongs (the output outside it)
    with pytest.raises(NotACheckpointError, match="--from dcp"):
        convert.from_lightning(str(tmp_path / "folder"), str(tmp_path / "out"))
    src = tmp_path / "plain.pt"
    torch.save({"model": _model(0).state_dict()}, src)
    with pytest.raises(NotACheckpointError, match="--from torch"):
        convert.from_lightning(str(src), str(tmp_path / "out"))
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="not a dict"):
        convert.from_torch(str(tmp_path / "list.pt"), str(tmp_path / "out"))


# ----------------------------------------------------------------------------- Lightning


def _lit_class() -> type:
    L = pytest.importorskip("lightning")
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    class Lit(L.LightningModule):
        def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(4, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g)
            return DataLoader(TensorDataset(x, y), batch_size=4)

    return Lit


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory) -> tuple[type, str, dict[str, Any], Any]:
    """A real Trainer (one process, CPU) saves ``last.ckpt`` after 2 epochs (ModelCheckpoint and
    EarlyStopping state in it). Returns (the class, the file, torch's own safe load of it, the
    trained module)."""
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    Lit = _lit_class()
    root = tmp_path_factory.mktemp("lit")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=[ModelCheckpoint(dirpath=str(root / "ck"), monitor="loss", save_last=True), EarlyStopping("loss")],
    )
    torch.manual_seed(0)
    module = Lit(hidden=8, lr=0.05)
    trainer.fit(module)
    path = str(root / "ck" / "last.ckpt")
    return Lit, path, torch.load(path, weights_only=True), module


def test_issue39_item12_lightning_ckpt_of_a_real_trainer(lightning_ckpt, tmp_path) -> None:
    """``--from lightning`` on a real Trainer's ``.ckpt``: weights and optimizer state load
    bit-exact into the module and the optimizer built as ``configure_optimizers`` builds it, and
    Lightning's trainer state (epoch, global step, loops, callbacks, schedulers, hyper-parameters)
    is kept whole under ``lightning``, equal to the file's as torch's own safe loader reads it."""
    from unickpt.integrations.lightning import read_lightning_dict

    Lit, path, saved, _ = lightning_ckpt
    out = str(tmp_path / "out")
    assert main(["convert", "--from", "lightning", path, out]) == 0

    module = Lit(hidden=8, lr=1.0)
    opt = torch.optim.AdamW(module.parameters(), lr=1.0)
    unickpt.load(out, {"model": module, "optimizer": opt}, strict=False)  # "lightning": the trainer's
    for k, v in saved["state_dict"].items():
        assert torch.equal(module.state_dict()[k], v), k
    got = opt.state_dict()
    want = saved["optimizer_states"][0]
    assert got["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)

    trainer_state = read_lightning_dict(out)
    expected = {k: v for k, v in saved.items() if k not in ("state_dict", "optimizer_states")}
    assert trainer_state.keys() == expected.keys()
    for key in ("epoch", "global_step", "loops", "lr_schedulers", "hyper_parameters", "hparams_name"):
        assert trainer_state[key] == expected[key], key
    assert trainer_state["global_step"] == 12 and trainer_state["epoch"] == 1
    for name, cb in expected["callbacks"].items():
        for k, v in cb.items():
            w = trainer_state["callbacks"][name][k]
            assert torch.equal(w, v) if isinstance(v, torch.Tensor) else w == v, (name, k)


# ----------------------------------------------------------------------------- item 13


def test_issue39_item13_load_from_checkpoint_of_a_unickpt_folder(lightning_ckpt, tmp_path) -> None:
    """``LitModel.load_from_checkpoint(<unickpt folder>)`` raises ``IsADirectoryError`` (Lightning
    reads one file with torch.load); ``unickpt.integrations.lightning.load_from_checkpoint`` builds
    the module from the saved hyper-parameters (``kwargs`` overriding them) and loads its weights,
    and a module that mixes in ``UnickptLoadFromCheckpoint`` does the same through the stock call,
    while a ``.ckpt`` file still loads through Lightning's own."""
    from unickpt.integrations.lightning import UnickptLoadFromCheckpoint, load_from_checkpoint

    Lit, path, saved, trained = lightning_ckpt
    out = str(tmp_path / "out")
    convert.from_lightning(path, out)

    with pytest.raises(IsADirectoryError):  # the stock call: what the repro shows
        Lit.load_from_checkpoint(out)

    module = load_from_checkpoint(Lit, out)
    assert type(module) is Lit and dict(module.hparams) == {"hidden": 8, "lr": 0.05}
    assert module.state_dict().keys() == saved["state_dict"].keys()
    for k, v in saved["state_dict"].items():
        assert torch.equal(module.state_dict()[k], v), k
        assert torch.equal(trained.state_dict()[k], v), k

    overridden = load_from_checkpoint(Lit, out, lr=0.5)
    assert overridden.hparams.lr == 0.5 and overridden.hparams.hidden == 8

    class MixedLit(UnickptLoadFromCheckpoint, Lit):
        pass

    from_folder = MixedLit.load_from_checkpoint(out)
    from_file = MixedLit.load_from_checkpoint(path)  # Lightning's own path for a file
    for k, v in saved["state_dict"].items():
        assert torch.equal(from_folder.state_dict()[k], v), k
        assert torch.equal(from_file.state_dict()[k], v), k

    # a unickpt checkpoint without Lightning's dict: a clear error, not a KeyError
    plain = str(tmp_path / "plain")
    unickpt.save(plain, {"model": Lit()})
    with pytest.raises(NotACheckpointError, match="no Lightning trainer state"):
        load_from_checkpoint(Lit, plain)


def test_issue39_item12_load_of_a_torch_save_file_names_the_conversion(tmp_path) -> None:
    """``unickpt.load("ckpt.pt", state)`` on the file a plain script saved: the error says how to
    import it (today: "not a unickpt checkpoint" and nothing else)."""
    src = tmp_path / "ckpt.pt"
    torch.save({"model": _model(0).state_dict()}, src)
    with pytest.raises(NotACheckpointError, match="unickpt convert --from torch"):
        unickpt.load(str(src), {"model": _model(1)})
