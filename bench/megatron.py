"""unickpt vs megatron-core's dist_checkpointing on a megatron-core GPT with the distributed optimizer.

One run, 4 gloo ranks at TP2 x PP2 (CPU; megatron's CUDA calls patched as in the test bed
``tests/workers/megatron_env.py``), rounds interleaved:
  * save: ``unickpt.save(framework="megatron")`` vs ``dist_checkpointing.save`` (torch_dist, the
    default strategy) of ``{"model": chunk.sharded_state_dict(), "optimizer":
    optimizer.sharded_state_dict(..., fully_reshardable)}`` — the form Megatron needs to change
    TP/PP — and of the cheaper ``dp_reshardable`` form (DP changes only);
  * load at the same layout: ``unickpt.load`` vs ``dist_checkpointing.load`` + the model's and
    optimizer's ``load_state_dict`` (as Megatron-LM does), from the fully_reshardable checkpoint;
  * resharding load TP2xPP2 -> TP1xPP1 on 1 rank (distributed optimizer over DP 1): both tools.
Every load is checked against the saved full model once (the test bed's oracle). Medians, the
ratio dist_checkpointing / unickpt, and GB/s of the checkpoint bytes.

    python bench/megatron.py [--hidden 512] [--layers 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import dir_bytes, evict, fmt_gbs, fmt_s, machine_line, make_tmp, median, rmtree, spawn, table  # noqa: E402

# this file is named megatron.py: with its folder on the path, "import megatron.core" would find
# it; the spawned ranks inherit this path
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, os.path.dirname(HERE))  # the repo root: tests.workers.megatron_env

TIMES = ("unickpt save", "megatron save", "megatron save dp_reshardable", "unickpt load", "megatron load")


def _build(cfg: dict, tp: int, pp: int, dp: int, seed: int):
    from tests.workers import megatron_env as env

    return env.build_gpt(
        tp,
        pp,
        dp,
        seed=seed,
        use_distributed_optimizer=True,
        num_layers=cfg["layers"],
        hidden=cfg["hidden"],
        heads=cfg["heads"],
        vocab=cfg["vocab"],
        seq=16,
    )


def _megatron_target(cfg: dict, tp: int, pp: int, dp: int, seed: int):
    """A job megatron 0.16.1 can load into with torch's AdamW (no Apex/TE): its optimizer must
    already hold state (``DistributedOptimizer.state_dict`` asserts one ``step``), and the state
    setter must skip ``step`` (patch ``megatron_set_state_skips_step``)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from tests.workers import megatron_env as env

    if not getattr(DistributedOptimizer, "_bench_patched", False):
        DistributedOptimizer._set_main_param_and_optimizer_states = _set_states
        DistributedOptimizer._bench_patched = True
    chunks, opt = _build(cfg, tp, pp, dp, seed)
    env.train_step(chunks, opt, 5)
    return chunks, opt


def _set_states(self, model_param, tensors) -> None:
    """``megatron_set_state_skips_step``: DistributedOptimizer._set_main_param_and_optimizer_states
    of megatron-core 0.16.1 copies every key of the live torch state from ``tensors``, which for
    torch's AdamW includes ``step`` that the checkpoint keeps in the param groups (KeyError);
    this copies the keys the checkpoint has (the non-precision-aware path only)."""
    if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        raise NotImplementedError("bench patch covers the plain path only")
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    dst = {"param": main_param, **self.optimizer.state[main_param]}
    for key, value in tensors.items():
        if key in dst:
            dst[key].copy_(value)


def _sharded(chunks, opt, form: str, loading: bool = False) -> dict:
    """Megatron-LM's checkpoint dict: the model's sharded state dict and the optimizer's."""
    model_sd = chunks[0].module.sharded_state_dict() if len(chunks) == 1 else None
    if model_sd is None:
        raise ValueError("one chunk per rank in this benchmark")
    opt_sd = opt.sharded_state_dict(model_sd, is_loading=loading, metadata={"distrib_optim_sharding_type": form})
    return {"model": model_sd, "optimizer": opt_sd}


def _megatron_save(chunks, opt, path: str, form: str) -> None:
    from megatron.core import dist_checkpointing

    from tests.workers import megatron_env as env

    os.makedirs(path, exist_ok=True)
    with env.cpu_device_mode():
        dist_checkpointing.save(_sharded(chunks, opt, form), path)


def _megatron_load(chunks, opt, path: str) -> None:
    from megatron.core import dist_checkpointing

    from tests.workers import megatron_env as env

    with env.cpu_device_mode():
        loaded = dist_checkpointing.load(_sharded(chunks, opt, "fully_reshardable", loading=True), path)
        chunks[0].module.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])


def _check(got: dict, want: dict, what: str) -> None:
    import torch

    if got.keys() != want.keys() or any(not torch.equal(got[k], want[k]) for k in want):
        raise AssertionError(f"{what} differs from the saved model")


def _timed(fn) -> float:
    import time

    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def save_side(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    import unickpt
    from tests.workers import megatron_env as env

    torch.set_num_threads(1)
    chunks, opt = _build(cfg, 2, 2, 1, seed=1)
    env.train_step(chunks, opt, 0)
    full = env.full_model_state(chunks, sharded_keys=True)
    times: dict[str, list[float]] = {k: [] for k in TIMES}
    fresh, fresh_opt = _build(cfg, 2, 2, 1, seed=2)  # a resumed job: no optimizer state yet
    for r in range(cfg["rounds"]):
        u, m, m_dp = (os.path.join(cfg["tmp"], f"{k}{r}") for k in ("u", "m", "mdp"))
        times["unickpt save"].append(_timed(lambda u=u: unickpt.save(u, {"model": chunks, "optimizer": opt})))
        times["megatron save"].append(_timed(lambda m=m: _megatron_save(chunks, opt, m, "fully_reshardable")))
        times["megatron save dp_reshardable"].append(
            _timed(lambda m=m_dp: _megatron_save(chunks, opt, m, "dp_reshardable"))
        )
        if rank == 0:
            evict([u, m])
        dist.barrier()
        times["unickpt load"].append(
            _timed(lambda u=u, s={"model": fresh, "optimizer": fresh_opt}: unickpt.load(u, s, framework="megatron"))
        )
        if r == 0:
            _check(env.full_model_state(fresh, sharded_keys=True), full, "unickpt load")
        theirs, theirs_opt = _megatron_target(cfg, 2, 2, 1, seed=4 + r)
        if rank == 0:
            evict([m])
        dist.barrier()
        times["megatron load"].append(_timed(lambda m=m, c=theirs, o=theirs_opt: _megatron_load(c, o, m)))
        if r == 0:
            _check(env.full_model_state(theirs, sharded_keys=True), full, "megatron load")
        fresh, fresh_opt = _build(cfg, 2, 2, 1, seed=10 + r)
        if rank == 0 and r < cfg["rounds"] - 1:
            rmtree(m_dp)
        dist.barrier()
    sizes = {"u": dir_bytes(os.path.join(cfg["tmp"], "u0")), "m": dir_bytes(os.path.join(cfg["tmp"], "m0"))}
    _end_helpers()
    return {"times": times, "sizes": sizes, "full": full if rank == 0 else None}


def reshard_side(rank: int, world: int, cfg: dict, full: dict) -> dict:
    import torch

    import unickpt
    from tests.workers import megatron_env as env

    torch.set_num_threads(1)
    chunks, opt = _build(cfg, 1, 1, world, seed=3)
    times: dict[str, list[float]] = {"unickpt reshard": [], "megatron reshard": []}
    for r in range(cfg["rounds"]):
        u, m = (os.path.join(cfg["tmp"], f"{k}{r}") for k in ("u", "m"))
        if rank == 0:
            evict([u, m])
        times["unickpt reshard"].append(
            _timed(lambda u=u, s={"model": chunks, "optimizer": opt}: unickpt.load(u, s, framework="megatron"))
        )
        if r == 0:
            _check(env.full_model_state(chunks, sharded_keys=True), full, "unickpt resharding load")
        theirs, theirs_opt = _megatron_target(cfg, 1, 1, world, seed=4 + r)
        if rank == 0:
            evict([m])
        times["megatron reshard"].append(_timed(lambda m=m, c=theirs, o=theirs_opt: _megatron_load(c, o, m)))
        if r == 0:
            _check(env.full_model_state(theirs, sharded_keys=True), full, "megatron resharding load")
        chunks, opt = _build(cfg, 1, 1, world, seed=10 + r)
    _end_helpers()
    return {"times": times}


def _end_helpers() -> None:
    """dist_checkpointing's writer leaves multiprocessing helper processes (a Manager, started by
    its worker processes) behind; end every descendant of this rank, or they outlive the
    benchmark holding its output open."""
    import signal

    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    mine, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in mine} - mine
        grew = bool(more)
        mine |= more
    for pid in mine - {os.getpid()}:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reshard-ranks", type=int, default=1, help="TP1xPP1 world size (DP) of the resharding load")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    h, L, v = args.hidden, args.layers, args.vocab
    params = L * 12 * h * h + 2 * v * h
    cfg = {"hidden": h, "layers": L, "heads": args.heads, "vocab": v, "rounds": args.rounds}
    cfg["tmp"] = make_tmp(args.dir, params * 4 * 4 * 3 * args.rounds)
    print(f"megatron-core GPT: {L} layers, hidden {h}, vocab {v}: ~{params / 1e6:.0f}M params, fp32 + Adam")
    print(machine_line())
    try:
        res = spawn(save_side, 4, cfg, timeout=3000)
        rs = spawn(reshard_side, args.reshard_ranks, cfg, res[0]["full"], timeout=3000)
    finally:
        rmtree(cfg["tmp"])
    t = {**res[0]["times"], **rs[0]["times"]}
    ub, mb = res[0]["sizes"]["u"], res[0]["sizes"]["m"]

    def row(op: str, ours: str, theirs: str, nb_ours: int, nb_theirs: int) -> list[str]:
        a, b = median(t[ours]), median(t[theirs])
        return [op, fmt_s(a), fmt_gbs(nb_ours, a), fmt_s(b), fmt_gbs(nb_theirs, b), f"{b / a:.2f}x"]

    rows = [
        row("save TP2xPP2 (4 ranks)", "unickpt save", "megatron save", ub, mb),
        row("  vs megatron dp_reshardable", "unickpt save", "megatron save dp_reshardable", ub, mb),
        row("load, same layout", "unickpt load", "megatron load", ub, mb),
        row(f"resharding load -> TP1xPP1 ({args.reshard_ranks} rank)", "unickpt reshard", "megatron reshard", ub, mb),
    ]
    print(
        table(
            f"medians of {args.rounds}; checkpoint bytes: unickpt {ub / 1e6:.0f} MB, megatron {mb / 1e6:.0f} MB",
            ["", "unickpt s", "GB/s", "dist_checkpointing s", "GB/s", "ratio"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
