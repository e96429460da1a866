"""One rank of the two-host tests (``test_two_hosts.py``), started inside a network + UTS + PID
namespace that stands for a host: ``python twohost_worker.py SCENARIO CKPT OUT`` with the
process group in the environment (``MASTER_ADDR`` on the first host's veth address, ``RANK``,
``WORLD_SIZE``, ``GLOO_SOCKET_IFNAME``). Writes its report as JSON to ``OUT`` (never pickle).

Scenarios
- ``save``: FSDP2 toy model, two training steps, save; rank 0 writes the full reference state
  and the next step's loss (``torch.save`` of plain tensors, read back with ``weights_only``).
- ``load``: a fresh FSDP2 model (any world size) loads it with the default (automatic) read
  deduplication; the report holds the host name, the bytes this rank read, the keys that
  differ from the reference and whether the next loss is the uninterrupted run's.
- ``load_replicated``: a fresh DDP model (every rank needs every byte) loads it the same way;
  the report holds the host name, the bytes read and forwarded, the keys that differ.
- ``loads``: ``load`` then ``load_replicated`` in one job (each counts only its own load's
  bytes): ``{"load": report, "load_replicated": report}``.
- ``crash_in_commit``: save step 1, then the coordinator (rank 0) is SIGKILLed entering the
  metadata publication of the next save over the same folder: the lock stays behind.
- ``save_again``: a new job tries to save over that folder (reporting the error it got).
"""

from __future__ import annotations

import json
import os
import socket
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.join(_HERE, "..", ".."),):  # the repo root: tests.workers
    if _p not in sys.path:
        sys.path.insert(0, _p)


def _report_read_bytes(rank: int) -> list[int]:
    import unickpt

    total = [0]

    def listener(ev) -> None:  # type: ignore[no-untyped-def]
        if ev.phase == "load.read" and ev.rank == rank:
            total[0] += int(ev.nbytes or 0)

    unickpt.default_checkpointer().events.add_listener(listener)
    return total


def save(rank: int, ckpt: str) -> dict:
    import torch

    import unickpt
    from tests.support.reference import full_state
    from unickpt.testing.toy import build, train_step

    model, optim = build("fsdp2", seed=0)
    for s in range(2):
        train_step(model, optim, s)
    small_chunks = unickpt.SaveOptions(checksum_chunk_bytes=4096)  # a small model over many chunks
    state = {"model": model, "optimizer": optim, "extra_state": {"step": 2}}
    unickpt.save(ckpt, state, framework="fsdp2", options=small_chunks)
    ref = full_state(model, optim)
    ref["next_loss"] = torch.tensor(train_step(model, optim, 2), dtype=torch.float64)
    if rank == 0:
        torch.save(ref, ckpt + ".ref.pt")
    return {"host": socket.gethostname()}


def load(rank: int, ckpt: str) -> dict:
    import torch

    import unickpt
    from tests.support.reference import full_state
    from unickpt.testing.toy import build, train_step

    ref = torch.load(ckpt + ".ref.pt", weights_only=True)
    next_loss = float(ref.pop("next_loss"))
    fresh, fresh_optim = build("fsdp2", seed=1234)
    read = _report_read_bytes(rank)
    state = {"model": fresh, "optimizer": fresh_optim, "extra_state": None}
    unickpt.load(ckpt, state, framework="fsdp2")
    got = full_state(fresh, fresh_optim)
    bad = sorted(k for k in set(ref) | set(got) if k not in got or k not in ref or not torch.equal(got[k], ref[k]))
    loss = train_step(fresh, fresh_optim, 2)
    return {
        "host": socket.gethostname(),
        "read_bytes": read[0],
        "mismatched": bad,
        "loss_equal": loss == next_loss,
        "step": state["extra_state"]["step"],
    }


def load_replicated(rank: int, ckpt: str) -> dict:
    import torch

    import unickpt
    from tests.support.reference import full_state
    from unickpt.testing.toy import build

    ref = torch.load(ckpt + ".ref.pt", weights_only=True)
    ref.pop("next_loss")
    fresh, fresh_optim = build("ddp", seed=1234)
    read = _report_read_bytes(rank)
    moved = [0]
    unickpt.default_checkpointer().events.add_listener(
        lambda ev: moved.__setitem__(0, moved[0] + int(ev.nbytes or 0)) if ev.phase == "load.transfer" else None
    )
    unickpt.load(ckpt, {"model": fresh, "optimizer": fresh_optim}, framework="ddp")
    got = full_state(fresh, fresh_optim)
    bad = sorted(k for k in set(ref) | set(got) if k not in got or k not in ref or not torch.equal(got[k], ref[k]))
    return {"host": socket.gethostname(), "read_bytes": read[0], "moved_bytes": moved[0], "mismatched": bad}


def loads(rank: int, ckpt: str) -> dict:
    """``load``, then ``load_replicated``, in one process group (one start-up for both)."""
    return {"load": load(rank, ckpt), "load_replicated": load_replicated(rank, ckpt)}


def crash_in_commit(rank: int, ckpt: str) -> dict:
    import torch.distributed as dist

    import unickpt
    from tests.workers.rel_helpers import kill_in_commit
    from unickpt.testing.toy import build, train_step

    model, optim = build("fsdp2", seed=0)
    train_step(model, optim, 0)
    unickpt.save(ckpt, {"model": model, "optimizer": optim, "extra_state": {"step": 1}}, framework="fsdp2")
    dist.barrier()
    train_step(model, optim, 1)
    if rank == 0:
        kill_in_commit("enter")
    unickpt.save(ckpt, {"model": model, "optimizer": optim, "extra_state": {"step": 2}}, framework="fsdp2")
    return {"host": socket.gethostname(), "survived": True}


def save_again(rank: int, ckpt: str) -> dict:
    import unickpt
    from unickpt.testing.toy import build, train_step

    model, optim = build("fsdp2" if int(os.environ["WORLD_SIZE"]) > 1 else "torch", seed=5)
    train_step(model, optim, 0)
    try:
        unickpt.save(ckpt, {"model": model, "optimizer": optim, "extra_state": {"step": 9}})
        return {"host": socket.gethostname(), "error": None}
    except unickpt.CheckpointError as e:
        return {"host": socket.gethostname(), "error": type(e).__name__, "msg": str(e)}


def main() -> None:
    scenario, ckpt, out = sys.argv[1:4]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if ws > 1:
        dist.init_process_group("gloo", rank=rank, world_size=ws)
    try:
        scenarios = {
            "save": save,
            "load": load,
            "load_replicated": load_replicated,
            "loads": loads,
            "crash_in_commit": crash_in_commit,
            "save_again": save_again,
        }
        report = scenarios[scenario](rank, ckpt)
    finally:
        if ws > 1 and dist.is_initialized():
            dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
