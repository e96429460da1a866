"""What a distributed load does besides reading bytes (issue 40: a RAM recovery pays it too).

* Ranks that all run on one host, loading local files (read through that host's page cache),
  exchange no needs: the load's collectives are the describe, metadata, validate, read and
  apply stages' five, and every byte is read through the shared page cache, as the read
  assignment would have had it. Ranks on different hosts (host names patched per rank) still
  exchange their needs (two more collectives, the ``load.exchange`` phase) and forward what
  several of them need, and so do ranks of one host when one of them reads through other
  storage (the decision is the same on every rank). All load bit-exact.
* A process forked from one whose checkpointer keeps reader threads (``ReaderThreads``) loads on
  threads of its own (the parent's do not exist in the child: borrowing them would hang).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from tests.workers.harness import run_ranks


class _NoReadAhead:
    """A storage read as if it had no read-ahead (as the RAM tier's feed wraps a rank's storage)."""

    def __init__(self, inner) -> None:
        import dataclasses

        self.inner = inner
        self.capabilities = dataclasses.replace(inner.capabilities, reads_ahead=False)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _load_counting(rank: int, ws: int, ckpt: str, hosts: bool, wrapped: int = -1) -> dict:
    import socket

    if hosts:  # a host of its own for every rank
        socket.gethostname = lambda: f"host-{rank}"  # type: ignore[assignment]
    import unickpt
    from tests.support.reference import full_state
    from unickpt.coordination.torch_dist import TorchDistCoordinator
    from unickpt.storage.local import LocalStorage
    from unickpt.testing.toy import build, train_step

    model, optim = build("ddp", seed=0)
    train_step(model, optim, 0)
    unickpt.save(ckpt, {"model": model, "optimizer": optim})
    ref = full_state(model, optim)

    ops: list[str] = []
    run = TorchDistCoordinator._run

    def counted(self, op, fn):
        ops.append(op)
        return run(self, op, fn)

    cached = {"n": 0}
    plain = LocalStorage.read_into_cached

    def counting(self, name, offset, out):
        cached["n"] += len(out)
        plain(self, name, offset, out)

    phases: list[str] = []
    read: list[int] = []

    def listen(ev) -> None:
        phases.append(ev.phase)
        if ev.phase == "load.read":
            read.append(ev.nbytes)

    unickpt.default_checkpointer().events.add_listener(listen)
    model2, optim2 = build("ddp", seed=7)
    TorchDistCoordinator._run = counted  # type: ignore[method-assign]
    LocalStorage.read_into_cached = counting  # type: ignore[method-assign]
    try:
        state = {"model": model2, "optimizer": optim2}
        unickpt.default_checkpointer().load(ckpt, state, source=_NoReadAhead if rank == wrapped else None)
    finally:
        TorchDistCoordinator._run = run  # type: ignore[method-assign]
        LocalStorage.read_into_cached = plain  # type: ignore[method-assign]
    got = full_state(model2, optim2)
    return {
        "exact": all(torch.equal(ref[k], got[k]) for k in ref),
        "ops": ops,
        "exchange": "load.exchange" in phases,
        "read": sum(read),
        "cached": cached["n"],
    }


FIVE = ["all_gather_object", "broadcast_object", "all_gather_object", "all_gather_object", "all_gather_object"]


def test_ranks_on_one_host_exchange_no_needs_and_ranks_on_several_hosts_do(tmp_path) -> None:
    one = run_ranks(_load_counting, 2, str(tmp_path / "one"), False)
    for r in one:
        assert r["exact"]
        assert r["ops"] == FIVE  # describe, metadata, validate, read, apply
        assert not r["exchange"]
        assert r["read"] > 0 and r["cached"] == r["read"]  # every byte through the shared page cache
    several = run_ranks(_load_counting, 2, str(tmp_path / "several"), True)
    for r in several:
        assert r["exact"]
        want = FIVE[:3] + ["gather_object", "scatter_object"] + FIVE[3:]  # the needs exchanged in the read stage
        assert r["ops"] == want
        assert r["exchange"]
    # DDP: both ranks need every byte; across hosts each byte is read by one of them and forwarded
    assert sum(r["read"] for r in several) == one[0]["read"]


def test_when_one_rank_reads_through_other_storage_every_rank_exchanges(tmp_path) -> None:
    """All ranks on one host, but rank 1 reads through a wrapper without read-ahead (as a rank of
    the RAM tier's recovery fed by its peers does): the ranks decide together, so both exchange
    their needs (a rank skipping the exchange alone would leave the other waiting in it)."""
    for r in run_ranks(_load_counting, 2, str(tmp_path / "c"), False, 1):
        assert r["exact"]
        assert r["ops"] == FIVE[:3] + ["gather_object", "scatter_object"] + FIVE[3:]
        assert r["exchange"]


def _child_loads(ck, path: str, want: dict[str, torch.Tensor], out) -> None:
    from torch import nn

    m = nn.Linear(64, 64)
    ck.load(path, {"model": m})
    out.put(all(torch.equal(v, want[k]) for k, v in m.state_dict().items()))


@pytest.mark.timeout(300)
def test_a_process_forked_after_a_load_loads_on_threads_of_its_own(tmp_path) -> None:
    import threading

    from torch import nn

    import unickpt

    path = str(tmp_path / "ck")
    saved = nn.Linear(64, 64)
    unickpt.save(path, {"model": saved}, options=unickpt.SaveOptions(files_per_rank=2))
    want = {k: v.clone() for k, v in saved.state_dict().items()}
    with unickpt.Checkpointer() as ck:
        ck.load(path, {"model": nn.Linear(64, 64)})  # the parent now keeps reader threads
        assert any(t.name.startswith("unickpt-read") for t in threading.enumerate())
        ctx = multiprocessing.get_context("fork")
        out = ctx.SimpleQueue()
        child = ctx.Process(target=_child_loads, args=(ck, path, want, out))
        child.start()
        child.join(120)  # on the parent's pools the child's reads would never run: it would hang
        if child.exitcode is None:
            child.kill()
        assert child.exitcode == 0
        assert out.get() is True
        m = nn.Linear(64, 64)
        ck.load(path, {"model": m})  # the parent's threads still serve the parent
        assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
