"""unickpt as Lightning's checkpoint backend (``unickpt.integrations.lightning``), against the real
``lightning`` package: a Trainer on 2 gloo processes (DDP with async saves, and FSDP2 through
``ModelParallelStrategy``) checkpoints every epoch through ``ModelCheckpoint`` (every epoch,
``save_last``, and a newest-only callback whose older checkpoints are removed), then resumes on
3 processes from the first epoch's checkpoint and on 1 process with ``ckpt_path="last"``. The
expected losses are stock Lightning's: the same Trainer with Lightning's own strategy and
checkpoints, saved and resumed the same way in the same spawns. The same spawns run a Fabric
loop saved with ``fabric.save`` and resumed with ``fabric.load`` through unickpt's Fabric
strategies, against stock Fabric. One spawn per world size; FSDP1 (``FSDPStrategy``) in spawns of
its own (its test's docstring says how it runs on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

import unickpt
from tests.workers.harness import run_ranks
from tests.workers.lightning_workers import KINDS, resume, train
from unickpt.format.records import METADATA_FILE
from unickpt.integrations._delete import delete_checkpoint
from unickpt.ops.inspect import load_metadata

_TINY_KEYS = ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]  # Tiny's nn.Sequential, sorted


def _per_rank(results: list[dict], kind: str, backend: str) -> list[list[float]]:
    return [r[f"{kind}/{backend}"] for r in results]


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory) -> tuple[str, dict, list[dict], list[dict], list[dict]]:
    """Every kind (KINDS and "fsdp1") trained and saved on 2 processes, resumed on 3 (from epoch 0)
    and on 1 (``"last"``): one spawn per world size for all kinds. Returns ``(root, files, trained,
    on3, on1)``; ``files``: what the training left (before the resumes add to the same folders)."""
    root = str(tmp_path_factory.mktemp("lightning"))
    kinds = (*KINDS, "fsdp1")
    names = ",".join(kinds)
    trained = run_ranks(train, 2, root, names, timeout=500)
    files: dict = {}
    for kind in kinds:
        for name in ("epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"):
            files[f"{kind}/{name}"] = os.path.isfile(os.path.join(root, kind, "unickpt", name, METADATA_FILE))
        for backend in ("unickpt", "stock"):
            files[f"{kind}/{backend}/latest"] = os.listdir(os.path.join(root, kind, backend, "latest"))
    on3 = run_ranks(resume, 3, root, "epoch0", names, timeout=500)
    on1 = run_ranks(resume, 1, root, "last", names, timeout=500)
    return root, files, trained, on3, on1


def test_trainer_checkpoints_and_resumes_on_1_and_3_processes_like_stock_lightning(lightning_runs) -> None:
    _check_saved_on_2_resumed_on_3_and_1(*lightning_runs, KINDS)


def test_fsdp1_strategy_checkpoints_and_resumes_on_1_and_3_processes_like_stock_lightning(lightning_runs) -> None:
    """``UnickptFSDPStrategy`` / ``UnickptFabricFSDPStrategy`` (FSDP1), the same Trainer and Fabric checks
    as the test above (in the same spawns). The real classes run on CPU: Lightning's connectors
    refuse only ``type(strategy) is FSDPStrategy`` without a GPU, and the module is wrapped by the
    user (``configure_model`` / before ``fabric.setup_module``) on the CPU device, because Lightning's
    own wrapping passes ``device_id=None``, which torch's FSDP1 refuses without an accelerator. Stock is
    Lightning's ``FSDPStrategy`` with ``state_dict_type="sharded"`` (``StockFSDPStrategy``)."""
    root = lightning_runs[0]
    _check_saved_on_2_resumed_on_3_and_1(*lightning_runs, ("fsdp1",))
    for saved in ("fsdp1/unickpt/epoch=0.ckpt", "fabric/fsdp1/unickpt/step3"):
        # every rank saved its FSDP1 flat-parameter shards (not a gathered copy)
        _, meta, _ = load_metadata(os.path.join(root, saved))
        assert (meta.topology.framework, meta.topology.world_size) == ("fsdp", 2), saved


def _check_saved_on_2_resumed_on_3_and_1(
    root: str, files: dict, trained: list[dict], on3: list[dict], on1: list[dict], kinds: tuple[str, ...]
) -> None:
    """``kinds`` trained and saved on 2 processes, resumed on 3 (from epoch 0) and on 1 (``"last"``):
    every loss equals stock Lightning's."""
    for kind in kinds:
        # checkpointing does not change training; both backends train alike
        assert _per_rank(trained, kind, "unickpt") == _per_rank(trained, kind, "stock"), kind
        for name in ("epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"):
            assert files[f"{kind}/{name}"], name  # a unickpt checkpoint
        # the newest-only callback removed step 3 (DDP: while step 6 was being saved asynchronously),
        # as it does with Lightning's own files
        assert files[f"{kind}/unickpt/latest"] == ["step=6.ckpt"]
        assert files[f"{kind}/stock/latest"] == ["step=6.ckpt"]

    for kind in kinds:
        for results, steps in ((on3, 2), (on1, 6)):  # epoch 1 at 2 steps; epoch 2 at 6 steps
            ours, stock = _per_rank(results, kind, "unickpt"), _per_rank(results, kind, "stock")
            assert all(len(losses) == steps for losses in stock), (kind, stock)
            assert ours == stock, kind
        assert os.path.isfile(os.path.join(root, kind, "unickpt", "epoch=2.ckpt", METADATA_FILE))
        # on_load_checkpoint sees the loaded module's state dict under Lightning's names
        for results in (on3, on1):
            assert all(keys == _TINY_KEYS for keys in _per_rank(results, f"keys-{kind}", "unickpt")), kind
        # trainer.validate(ckpt_path=...) on 1 process: the module alone, no optimizer exists
        val = f"validate-{kind}"
        assert len(_per_rank(on1, val, "stock")[0]) == 6
        assert _per_rank(on1, val, "unickpt") == _per_rank(on1, val, "stock"), val

    # Fabric: fabric.save after 3 steps at ws=2, fabric.load on 3 and on 1 process, 2 more steps
    for kind in kinds:
        fab = f"fabric-{kind}"
        assert _per_rank(trained, fab, "unickpt") == _per_rank(trained, fab, "stock"), fab
        assert os.path.isfile(os.path.join(root, "fabric", kind, "unickpt", "step3", METADATA_FILE))
        for results in (on3, on1):
            ours, stock = _per_rank(results, fab, "unickpt"), _per_rank(results, fab, "stock")
            assert all(losses[-1] == 5.0 for losses in stock), stock  # the step counter restored: 3 + 2
            assert ours == stock, fab


def test_delete_checkpoint_removes_only_unickpts_files(tmp_path) -> None:
    import torch

    path = str(tmp_path / "epoch=0.ckpt")
    unickpt.save(path, {"model": torch.nn.Linear(2, 2)})
    assert delete_checkpoint(path) and not os.path.exists(path)

    unickpt.save(path, {"model": torch.nn.Linear(2, 2)})
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("the user's")
    mine = os.path.join(path, "data", "mine.bin")
    with open(mine, "w") as f:
        f.write("the user's too")
    assert delete_checkpoint(path)
    assert sorted(os.listdir(path)) == ["data", "notes.txt"] and os.listdir(os.path.join(path, "data")) == ["mine.bin"]

    stock = tmp_path / "stock.ckpt"  # a file (Lightning's own checkpoint) is not unickpt's: left alone
    stock.write_bytes(b"lightning's own")
    assert not delete_checkpoint(str(stock)) and stock.read_bytes() == b"lightning's own"
    sharded = tmp_path / "sharded.ckpt"  # a folder unickpt did not write (a DCP checkpoint): left alone
    sharded.mkdir()
    (sharded / "x.pt").write_bytes(b"1")
    assert not delete_checkpoint(str(sharded)) and (sharded / "x.pt").exists()


def test_remove_checkpoint_removes_a_link_not_the_checkpoint_it_points_to(tmp_path) -> None:
    """ModelCheckpoint(save_last="link") removes its previous link with strategy.remove_checkpoint: the
    link goes, the checkpoint it points to stays whole (it used to be emptied through the link)."""
    import torch

    from unickpt.integrations.lightning import UnickptDDPStrategy

    target = tmp_path / "epoch=0.ckpt"
    unickpt.save(str(target), {"model": torch.nn.Linear(2, 2)})
    files = sorted(os.listdir(target))
    (tmp_path / "last.ckpt").symlink_to("epoch=0.ckpt")
    UnickptDDPStrategy().remove_checkpoint(tmp_path / "last.ckpt")
    assert os.listdir(tmp_path) == ["epoch=0.ckpt"]
    assert sorted(os.listdir(target)) == files


def test_import_unickpt_does_not_import_lightning() -> None:
    code = "import sys, unickpt; print('lightning' in sys.modules or 'lightning.pytorch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert out.stdout.strip() == "False"
