"""Rank functions of ``tests/integration/storage/test_recovery_processes.py``: simulated hosts
(``UNICKPT_HOST_ID`` and a private ``UNICKPT_SHM_ROOT`` per host) saving to and recovering from
``TieredCheckpointManager(replicas >= 1)``."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

ROWS, COLS = 240, 96  # divisible by 1..6 ranks


def enter_host(base: str, host: str) -> None:
    """This process is on ``host``: its RAM is ``base/ram/<host>``, or ``RECOVERY_TEST_RAM`` (the
    mount-namespace test: one path, a private tmpfs in each host's namespace)."""
    os.environ["UNICKPT_HOST_ID"] = host
    os.environ["UNICKPT_SHM_ROOT"] = os.environ.get("RECOVERY_TEST_RAM") or os.path.join(base, "ram", host)


def expected(step: int) -> dict[str, torch.Tensor]:
    """The state at ``step``, from a seeded generator (not from the code under test)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(ROWS, COLS, generator=g), "bias": torch.randn(16, generator=g)}


def _state(step: int | None, with_bias: bool) -> dict[str, Any]:
    """``{"model": m}``: ``m.w`` a DTensor sharded by rows over every rank, ``m.bias`` (when asked)
    a plain buffer every rank holds (saved once, by rank 0)."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    values = expected(step) if step is not None else {k: torch.zeros_like(v) for k, v in expected(0).items()}
    m = nn.Module()
    m.w = nn.Parameter(distribute_tensor(values["w"], mesh, [Shard(0)]), requires_grad=False)
    if with_bias:
        m.register_buffer("bias", values["bias"].clone())
    return {"model": m}


def _tiers(base: str, opts: dict[str, Any]) -> Any:
    import unickpt

    opts = dict(opts)
    opts.pop("_expect_failure", None)
    opts.pop("_verify", None)
    durable = opts.pop("_durable", os.path.join(base, "durable"))
    return unickpt.TieredCheckpointManager("shm://job", durable, **opts)


def save_steps(rank: int, ws: int, base: str, hosts: list[str], steps: list[int], opts: dict[str, Any],
               with_bias: bool = True) -> str | None:  # fmt: skip
    """Save ``steps``; with ``opts["_expect_failure"]`` the message of the failures ``close``
    raised (None if none)."""
    import unickpt

    enter_host(base, hosts[rank])
    tiers = _tiers(base, opts)
    for step in steps:
        tiers.save(step, _state(step, with_bias), async_save=True).wait_snapshot()
    try:
        tiers.close()
    except unickpt.AsyncSaveFailures as e:
        if not opts.get("_expect_failure"):
            raise
        return str(e)
    return None


def recover(rank: int, ws: int, base: str, hosts: list[str], opts: dict[str, Any],
            with_bias: bool = True) -> dict[str, Any]:  # fmt: skip
    import unickpt

    enter_host(base, hosts[rank])
    tiers = _tiers(base, opts)
    state = _state(None, with_bias)
    events: list[str] = []
    tiers._ckpt.events.add_listener(lambda e: events.append(e.detail) if e.detail.startswith("ram ") else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = tiers.load_latest(state)
    tiers.close()
    got = {"w": state["model"].w.full_tensor()}
    if with_bias:
        got["bias"] = state["model"].bias
    want = expected(step) if step is not None else {}
    r = tiers.last_recovery
    assert r is not None
    return {
        "step": step,
        "exact": step is not None and all(torch.equal(got[k], want[k]) for k in got),
        "tier": r.tier,
        "bytes": r.bytes_by_source,
        "peer_by_host": r.peer_bytes_by_host,
        "fed": r.fed_bytes,
        "failed": list(r.failed_copies),
        "skipped": list(r.skipped_steps),
        "events": events,
        "warnings": [str(w.message) for w in caught if "durable tier" in str(w.message)],
        "unickpt": unickpt.__file__,
    }


BIG_COLS = 2048  # a rank's shard of the big state: 1024 rows of 2048 float32 = 8 MiB


def _big_state(step: int | None, ws: int) -> dict[str, Any]:
    """``{"model": m}`` with one DTensor of ``ws`` x 8 MiB sharded by rows (a seeded generator's
    values at ``step``; zeros for None)."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    full = torch.zeros(ws * 1024, BIG_COLS)
    if step is not None:
        full = torch.randn(ws * 1024, BIG_COLS, generator=torch.Generator().manual_seed(2000 + step))
    m = nn.Module()
    m.big = nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]), requires_grad=False)
    return {"model": m}


def _bytes_read() -> int:
    """What this process has passed to read()/pread()/preadv() so far (``rchar``)."""
    with open("/proc/self/io", "rb") as fh:
        return int(next(line for line in fh if line.startswith(b"rchar:")).split()[1])


def save_big(rank: int, ws: int, base: str, hosts: list[str], opts: dict[str, Any]) -> None:
    enter_host(base, hosts[rank])
    tiers = _tiers(base, opts)
    tiers.save(1, _big_state(1, ws), async_save=True).wait_snapshot()
    tiers.close()


def recover_big(rank: int, ws: int, base: str, hosts: list[str], opts: dict[str, Any]) -> dict[str, Any]:
    """``load_latest`` of the big state: the step, whether every byte is the saved one, the bytes
    this process read during the call, and the error (class: message) if it raised."""
    import unickpt

    enter_host(base, hosts[rank])
    tiers = _tiers(base, opts)
    state = _big_state(None, ws)
    options = unickpt.LoadOptions(verify_checksums=opts.get("_verify", True))
    before = _bytes_read()
    try:
        step = tiers.load_latest(state, options=options)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "read": _bytes_read() - before}
    finally:
        tiers.close()
    read = _bytes_read() - before
    got = state["model"].big.full_tensor()
    exact = step is not None and torch.equal(got, _big_state(step, ws)["model"].big.full_tensor())
    return {"step": step, "exact": exact, "read": read, "error": ""}


def latest_step(rank: int, ws: int, base: str, hosts: list[str], opts: dict[str, Any]) -> list[Any]:
    """``TieredCheckpointManager.latest_step()`` as this rank sees it, or ``["error", "<class>: <message>"]``."""
    enter_host(base, hosts[rank])
    tiers = _tiers(base, opts)
    try:
        return list(tiers.latest_step())
    except Exception as e:
        return ["error", f"{type(e).__name__}: {e}"]
    finally:
        tiers.close()


def construct(rank: int, ws: int, base: str, hosts: list[str], opts_by_rank: list[dict[str, Any]]) -> str:
    """Construct the tier with this rank's options; the error's class and message, or ''."""
    enter_host(base, hosts[rank])
    try:
        _tiers(base, opts_by_rank[rank]).close()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def saves_a_nan_step(rank: int, ws: int, base: str, hosts: list[str], opts: dict[str, Any]) -> list[str]:
    """Steps 1 and 2 saved with ``check_finite=True``, step 2's ``w`` holding a NaN in rank 1's
    shard only; the warnings rank 0 got."""
    enter_host(base, hosts[rank])
    tiers = _tiers(base, {**opts, "check_finite": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiers.save(1, _state(1, True))
        state = _state(2, True)
        if rank == 1:
            with torch.no_grad():
                state["model"].w.to_local()[0, 0] = float("nan")
        tiers.save(2, state)
        tiers.close()
    return [str(w.message) for w in caught if "NaN" in str(w.message)]


def saves_then_gets_sigterm(rank: int, ws: int, base: str, hosts: list[str], opts: dict[str, Any]) -> None:
    """Steps 1-3 saved and committed in RAM (none due on the durable tier), then a real SIGTERM to
    this process: the tier's handler flushes step 3, then the signal ends the process."""
    import signal

    enter_host(base, hosts[rank])
    tiers = _tiers(base, opts)
    for step in (1, 2, 3):
        tiers.save(step, _state(step, True))
    tiers.wait()
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not end the process")


def recovers_then_gets_sigterm(rank: int, ws: int, base: str, hosts: list[str], opts: dict[str, Any]) -> None:
    """``load_latest`` (the step newest in RAM, not yet on the durable tier), then a real SIGTERM
    to this process: the tier's handler flushes that step to the durable tier, then the signal
    ends the process."""
    import signal

    enter_host(base, hosts[rank])
    tiers = _tiers(base, opts)
    tiers.load_latest(_state(None, True))
    tiers.wait()
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not end the process")


def loads_the_durable_step(rank: int, ws: int, base: str, hosts: list[str], step: int) -> bool:
    """A plain ``unickpt.load`` of ``step`` from the durable folder; whether it is bit-exact."""
    import unickpt

    state = _state(None, True)
    unickpt.load(os.path.join(base, "durable", f"step_{step:08d}"), state)
    want = expected(step)
    return torch.equal(state["model"].w.full_tensor(), want["w"]) and torch.equal(state["model"].bias, want["bias"])


def dies_while_replicating(rank: int, ws: int, base: str, hosts: list[str], opts: dict[str, Any], victim: str) -> None:
    """Step 1 saved and replicated; during step 2's replication the process of host ``victim``
    SIGKILLs itself as it starts writing its first replica (before any host's commit marker)."""
    import signal

    from unickpt.recovery import replicate

    enter_host(base, hosts[rank])
    tiers = _tiers(base, opts)
    tiers.save(1, _state(1, True))
    tiers.wait()
    if hosts[rank] == victim:
        replicate._write_replica = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment]
    tiers.save(2, _state(2, True))
    tiers.close()


def saves_after_a_link_is_planted(rank: int, ws: int, base: str, hosts: list[str], opts: dict[str, Any],
                                  victim: str, when: str, outside: str, aside: str) -> str:  # fmt: skip
    """Step 1 saved and replicated, then step 2, the tier open on every rank; host ``victim``'s
    rank (the attacker) swaps one of its RAM paths for a link to ``outside``, the original moved
    to ``aside``. ``when``: ``"between_saves"`` (before step 2's save: the folder of the replicas
    it holds for the first host, ``replicas/a``), ``"during_transfers"`` (the same folder, as
    step 2's replication starts writing on that host, after the check before it) or
    ``"before_durable_commit"`` (step 2's metadata in its own step folder, a link to the file
    ``outside``, as the durable copy of step 2 copies that host's files, before rank 0 reads the
    metadata to publish it). The failure ``close`` reports on this rank, as ``"Type: message"``
    ('' if none)."""
    import unickpt
    from unickpt.recovery import durable, replicate

    enter_host(base, hosts[rank])
    root = os.path.join(base, "ram", victim, f"unickpt-{os.getuid()}", "job")
    replicas = os.path.join(root, "replicas", hosts[0])

    def plant(path: str) -> None:
        os.rename(path, aside)
        os.symlink(outside, path)

    tiers = _tiers(base, opts)
    tiers.save(1, _state(1, True))
    tiers.wait()
    if hosts[rank] == victim and when == "between_saves":
        plant(replicas)
    elif hosts[rank] == victim and when == "during_transfers":
        write_replica = replicate._write_replica

        def planting_write_replica(*args: Any, **kwargs: Any) -> None:
            if not os.path.islink(replicas):
                plant(replicas)
            write_replica(*args, **kwargs)

        replicate._write_replica = planting_write_replica  # type: ignore[assignment]
    elif hosts[rank] == victim and when == "before_durable_commit":
        copy_file = durable._copy_file
        metadata = os.path.join(root, "step_00000002", "unickpt.metadata.json")

        def planting_copy_file(*args: Any, **kwargs: Any) -> None:
            copy_file(*args, **kwargs)
            if not os.path.islink(metadata):
                plant(metadata)

        durable._copy_file = planting_copy_file  # type: ignore[assignment]
    tiers.save(2, _state(2, True))
    try:
        tiers.close()
    except unickpt.AsyncSaveFailures as e:
        (_, error), *_ = e.failures
        return f"{type(error).__name__}: {error}"
    return ""


def main() -> None:
    """One rank as a plain process (the mount-namespace test starts it inside its host's mount
    namespace with ``nsenter``): ``python -m tests.workers.recovery_workers FN RANK WS PORT OUT
    ARGS_JSON``; writes ``fn(rank, ws, *args)`` as JSON to OUT. Under torchrun (the network-
    namespace test: one torchrun node per host) ``FN env OUT ARGS_JSON``: the rank, world size
    and master come from torchrun's environment, OUT gets ``.<rank>`` appended."""
    import json
    import sys

    if sys.argv[2] == "env":
        fn_name, out, args = sys.argv[1], sys.argv[3], sys.argv[4]
        rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        out = f"{out}.{rank}"
    else:
        fn_name, rank, ws, port, out, args = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5], sys.argv[6]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    try:
        result = {"save_steps": save_steps, "recover": recover}[fn_name](rank, ws, *json.loads(args))
    finally:
        dist.destroy_process_group()
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
