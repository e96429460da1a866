"""The unickpt demo (``make demo``, or ``python examples/demo.py --help``): train with FSDP2,
checkpoint, resume on another world size, prove bit-exactness.

Who calls what, in order (``main`` -> ``run_demo(DemoConfig)``, in the parent process):
  1. ``_spawn(_train_worker, world_size)``: every rank builds the toy transformer with FSDP2
     (``unickpt.testing.toy.build``), trains ``steps + extra_steps`` steps on the same global batch and saves
     every ``save_every`` steps up to ``steps`` to ``<out>/step_<n>`` with ``unickpt.save`` (the last
     save and every other one before it asynchronous). Right after the last save every rank
     gathers the full state (collective) and draws RNG probes; the run then goes on to be the
     uninterrupted reference. Each rank hands its losses, timings, state and probes back in a
     temp file (``torch.save``; read with ``torch.load(weights_only=True)``).
  2. ``_spawn(_resume_worker, resume_world_size)``: a freshly initialised model (another seed)
     loads the last checkpoint with ``unickpt.load`` (resharding), compares the full state, the
     param groups, the step counter and the restored RNG streams with the reference, then trains
     the remaining steps.
  3. ``_report``: checkpoint sizes and times, the state checks and both loss trajectories; the
     demo passes only if everything is bit-identical (``run_demo`` returns False otherwise).
The spawned functions live at module top level so ``torch.multiprocessing`` (spawn) can import
them (the spawned processes import this script as ``__mp_main__``); the parent's entry point is
guarded by ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unickpt.testing.launch import free_port
from unickpt.testing.toy import ToyConfig, build, train_step

__all__ = ["DemoConfig", "DemoResult", "run_demo"]

_FRAMEWORK = "fsdp2"


@dataclass(frozen=True)
class DemoConfig:
    """Settings of one demo run (``python examples/demo.py --help`` documents each)."""

    out: str = "./demo_out"
    steps: int = 6
    save_every: int = 2
    extra_steps: int = 4
    world_size: int = 4
    resume_world_size: int = 2
    dim: int = 130  # uneven shards on 4 ranks (33, 33, 33, 31 rows)
    layers: int = 4
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("steps", "save_every", "extra_steps", "world_size", "resume_world_size", "dim", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"demo setting {name} must be >= 1, got {getattr(self, name)}")
        if self.save_every > self.steps:
            raise ValueError(f"save_every {self.save_every} > steps {self.steps}: no checkpoint to resume from")

    @property
    def toy(self) -> ToyConfig:
        heads = next(h for h in (5, 4, 3, 2, 1) if self.dim % h == 0)
        return ToyConfig(
            vocab=203, dim=self.dim, heads=heads, layers=self.layers, ffn=self.dim * 8 // 3 + 3, seq=32, batch=8
        )

    @property
    def last_checkpoint(self) -> int:
        return self.steps // self.save_every * self.save_every

    @property
    def total_steps(self) -> int:
        return self.steps + self.extra_steps

    def checkpoint_path(self, step: int) -> str:
        return os.path.join(self.out, f"step_{step}")

    def is_async(self, step: int) -> bool:
        """The last save is asynchronous, and every other one before it."""
        return (self.last_checkpoint - step) // self.save_every % 2 == 0


@dataclass
class DemoResult:
    """What the parent learnt from both runs (``ok``: every check passed)."""

    ok: bool
    problems: list[str] = field(default_factory=list)
    report: str = ""


# ------------------------------------------------------------------------------ worker processes


def _init_rank(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def _rng_probe() -> dict[str, Any]:
    """The next values of the torch, python and numpy generators (consumes them)."""
    return {
        "torch": torch.rand(4, dtype=torch.float64),
        "python": [random.random() for _ in range(4)],
        "numpy": torch.from_numpy(np.random.rand(4)),
    }


def _param_groups(optim: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]


def _train_worker(rank: int, world_size: int, port: int, cfg: DemoConfig, exchange: str) -> None:
    """Phase 1, on every rank: train, save every ``save_every`` steps, go on as the reference."""
    import unickpt

    _init_rank(rank, world_size, port)
    c = cfg.toy
    # seed the generators the checkpoint restores, so the probes are the same on every run
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    model, optim = build(_FRAMEWORK, c, seed=0)
    losses: list[float] = []
    saves: list[dict[str, Any]] = []
    handles: list[tuple[int, float, Any]] = []  # (step, wall-clock start, SaveHandle)
    out: dict[str, Any] = {}
    for step in range(cfg.total_steps):
        losses.append(train_step(model, optim, step, c))
        done = step + 1
        if done > cfg.steps or done % cfg.save_every:
            continue
        rng = unickpt.rng_state()
        probe = _rng_probe()
        unickpt.set_rng_state(rng)  # training continues with the saved streams
        async_save = cfg.is_async(done)
        state = {"model": model, "optimizer": optim, "extra_state": {"step": done, "rng": rng}}
        wall0, t0 = time.time(), time.perf_counter()
        handle = unickpt.save(cfg.checkpoint_path(done), state, framework=_FRAMEWORK, async_save=async_save)
        blocked = time.perf_counter() - t0
        handles.append((done, wall0, handle))
        saves.append({"step": done, "async": async_save, "blocked_s": blocked})
        if done == cfg.last_checkpoint:
            out["probe"] = probe
            full = _full_state(model, optim)  # collective
            if rank == 0:
                out["state"] = full
                out["groups"] = _param_groups(optim)
    for (_done, wall0, handle), info in zip(handles, saves):
        md = handle.wait()  # re-raises a failed background save
        if md is not None:  # rank 0: the metadata was built just before the commit
            info["commit_s"] = max(md.created_unix - wall0, info["blocked_s"])
    out.update(losses=losses, saves=saves)
    torch.save(out, os.path.join(exchange, f"train_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor of the FSDP2 model as a full CPU tensor, keyed
    ``model.<name>`` / ``optimizer.state.<name>.<state>`` (FSDP2 adds nothing to parameter names).
    Gathered with torch's own ``DTensor.full_tensor()``, independently of unickpt's adapters, so
    the demo's proof does not rely on the code it checks. Collective: call on every rank."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()

    out = {}
    names = {}
    for n, p in model.named_parameters():
        out[f"model.{n}"] = full(p)
        names[id(p)] = n
    for g in optim.param_groups:
        for p in g["params"]:
            for k, v in optim.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"optimizer.state.{names[id(p)]}.{k}"] = full(v)
    return out


def _compare_state(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Every difference between two full states (names, dtypes, shapes, bits)."""
    problems = [f"{k}: saved but not in the resumed state" for k in sorted(set(want) - set(got))]
    problems += [f"{k}: in the resumed state but never saved" for k in sorted(set(got) - set(want))]
    for k in sorted(set(want) & set(got)):
        a, b = want[k], got[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{k}: saved {a.dtype} {tuple(a.shape)}, loaded {b.dtype} {tuple(b.shape)}")
        elif not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item()
            n = int((a != b).sum())
            problems.append(f"{k}: not bit-identical after load ({n} elements differ, max abs diff {diff:.3g})")
    return problems


def _resume_worker(rank: int, world_size: int, port: int, cfg: DemoConfig, exchange: str) -> None:
    """Phase 2, on every rank: load the last checkpoint into a fresh model, check, train on."""
    import unickpt

    _init_rank(rank, world_size, port)
    c = cfg.toy
    saved_ws = cfg.world_size
    mine = torch.load(os.path.join(exchange, f"train_rank{rank % saved_ws}.pt"), weights_only=True)
    ref = torch.load(os.path.join(exchange, "train_rank0.pt"), weights_only=True) if rank else mine
    model, optim = build(_FRAMEWORK, c, seed=1234)  # another init: everything must come from disk
    state: dict[str, Any] = {"model": model, "optimizer": optim, "extra_state": None}
    dist.barrier()
    t0 = time.perf_counter()
    unickpt.load(cfg.checkpoint_path(cfg.last_checkpoint), state, framework=_FRAMEWORK)
    load_s = time.perf_counter() - t0
    checks: dict[str, list[str]] = {"state": [], "groups": [], "step": [], "rng": []}
    got = _full_state(model, optim)  # collective
    if rank == 0:
        checks["state"] = _compare_state(ref["state"], got)
    if _param_groups(optim) != ref["groups"]:
        checks["groups"].append(f"rank {rank}: param_groups differ: {_param_groups(optim)} != {ref['groups']}")
    extra = state["extra_state"]
    step = extra.get("step") if isinstance(extra, dict) else None
    if step != cfg.last_checkpoint:
        checks["step"].append(f"rank {rank}: step counter {step!r} restored, expected {cfg.last_checkpoint}")
    if isinstance(extra, dict) and "rng" in extra:
        unickpt.set_rng_state(extra["rng"])
        probe, want_probe = _rng_probe(), mine["probe"]
        bad = [k for k in ("torch", "numpy") if not torch.equal(probe[k], want_probe[k])]
        bad += ["python"] if probe["python"] != want_probe["python"] else []
        if bad:
            checks["rng"].append(f"rank {rank}: RNG stream(s) {bad} differ from saved rank {rank % saved_ws}")
    else:
        checks["rng"].append(f"rank {rank}: no RNG state in the restored extra_state")
    losses = [train_step(model, optim, s, c) for s in range(cfg.last_checkpoint, cfg.total_steps)]
    out = {"losses": losses, "load_s": load_s, "checks": checks, "checked": len(got) if rank == 0 else 0}
    torch.save(out, os.path.join(exchange, f"resume_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ parent process


class DemoFailure(RuntimeError):
    """A phase of the demo crashed or timed out (the message holds the child's traceback)."""


def _spawn(fn: Callable[..., None], world_size: int, cfg: DemoConfig, exchange: str, phase: str) -> float:
    """Run ``fn(rank, world_size, port, cfg, exchange)`` on ``world_size`` spawned processes."""
    t0 = time.perf_counter()
    ctx = mp.start_processes(
        fn, args=(world_size, free_port(), cfg, exchange), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = t0 + cfg.timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.perf_counter() > deadline:
                raise DemoFailure(f"{phase} did not finish within {cfg.timeout_s:.0f} s")
    except mp.ProcessRaisedException as e:
        raise DemoFailure(f"{phase}: rank {e.error_index} failed:\n{str(e).strip()}") from None
    except mp.ProcessExitedException as e:
        raise DemoFailure(f"{phase}: rank {e.error_index} exited with code {e.exit_code}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return time.perf_counter() - t0


def _disk_usage(path: str) -> tuple[int, int]:
    """(bytes, files) under ``path``."""
    total = files = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            total += os.path.getsize(os.path.join(root, n))
            files += 1
    return total, files


def _fmt_loss(x: float) -> str:
    return f"{x:.10f}"


def _report(
    cfg: DemoConfig, train: list[dict[str, Any]], resume: list[dict[str, Any]], train_s: float, resume_s: float
) -> DemoResult:
    problems: list[str] = []
    r0 = train[0]
    ref_state: dict[str, torch.Tensor] = r0["state"]
    n_params = sum(t.numel() for k, t in ref_state.items() if k.startswith("model."))
    n_opt = sum(1 for k in ref_state if k.startswith("optimizer."))
    c = cfg.toy
    lines = [
        f"unickpt demo: {_FRAMEWORK} on {cfg.world_size} CPU processes (gloo), toy transformer "
        f"dim {c.dim}, {c.layers} layers, {n_params:,} parameters",
        f"trained {cfg.total_steps} steps (the uninterrupted reference), checkpoint every "
        f"{cfg.save_every} steps up to step {cfg.steps}, in {os.path.abspath(cfg.out)}",
        "",
        "checkpoints:",
    ]
    for s in r0["saves"]:
        nbytes, nfiles = _disk_usage(cfg.checkpoint_path(s["step"]))
        kind = (
            f"async: blocked {s['blocked_s']:.3f} s, committed after {s.get('commit_s', 0.0):.3f} s"
            if s["async"]
            else f"sync: saved in {s['blocked_s']:.3f} s"
        )
        lines.append(f"  step_{s['step']:<4} {nbytes:>10,} bytes in {nfiles} files   {kind}")
    lines.append(f"first run: {cfg.world_size} processes, {train_s:.1f} s wall (incl. start-up)")
    last = cfg.last_checkpoint
    load_s = max(r["load_s"] for r in resume)
    reshard = f"{cfg.world_size} -> {cfg.resume_world_size}"
    lines += [
        "",
        f"resumed from step_{last} on {cfg.resume_world_size} processes "
        f"({resume_s:.1f} s wall): load {load_s:.3f} s (resharding {reshard})",
    ]
    checks = {k: [p for r in resume for p in r["checks"][k]] for k in ("state", "groups", "step", "rng")}
    for found in checks.values():
        problems += found
    checked = resume[0]["checked"]
    lines.append(
        f"  state after load: {checked} tensors ({checked - n_opt} model, {n_opt} optimizer) "
        + ("bit-identical to the saved state" if not checks["state"] else "NOT bit-identical")
    )
    lines.append(
        f"  param_groups {'identical' if not checks['groups'] else 'DIFFER'}, step counter "
        f"{'restored (' + str(last) + ')' if not checks['step'] else 'WRONG'}, RNG (torch/python/"
        f"numpy) {'restored' if not checks['rng'] else 'NOT restored'} on {len(resume)} ranks"
    )
    ref_losses = r0["losses"][last:]
    lines += ["", f"  {'step':>4}  {'uninterrupted':>15}  {'resumed':>15}"]
    for i, want in enumerate(ref_losses):
        got_all = [r["losses"][i] for r in resume]
        same = all(g == want for g in got_all)
        lines.append(
            f"  {last + i:>4}  {_fmt_loss(want):>15}  {_fmt_loss(got_all[0]):>15}  "
            + ("identical" if same else "DIFFERENT")
        )
        if not same:
            problems.append(
                f"step {last + i}: loss {[g.hex() for g in got_all]} != {want.hex()} (resumed vs uninterrupted)"
            )
    ok = not problems
    lines.append("")
    lines.append(f"resharding {reshard}: " + ("OK" if ok else f"FAILED ({len(problems)} problem(s))"))
    lines += [f"  {p}" for p in problems[:30]]
    lines.append(f"(look inside: unickpt inspect {cfg.checkpoint_path(last)})")
    return DemoResult(ok, problems, "\n".join(lines))


def run_demo(cfg: DemoConfig, *, echo: Callable[[str], None] = print) -> bool:
    """Run both phases and print the report with ``echo``; True when everything matched."""
    os.makedirs(cfg.out, exist_ok=True)
    c = cfg.toy
    echo(
        f"unickpt demo: training {cfg.total_steps} steps with {_FRAMEWORK} on {cfg.world_size} "
        f"processes (dim {c.dim}, {c.layers} layers), then resuming step_{cfg.last_checkpoint} on "
        f"{cfg.resume_world_size} ..."
    )
    with tempfile.TemporaryDirectory(prefix="unickpt-demo-") as exchange:
        try:
            train_s = _spawn(_train_worker, cfg.world_size, cfg, exchange, "training run")
            train = [
                torch.load(os.path.join(exchange, f"train_rank{r}.pt"), weights_only=True)
                for r in range(cfg.world_size)
            ]
            resume_s = _spawn(_resume_worker, cfg.resume_world_size, cfg, exchange, "resumed run")
            resume = [
                torch.load(os.path.join(exchange, f"resume_rank{r}.pt"), weights_only=True)
                for r in range(cfg.resume_world_size)
            ]
        except DemoFailure as e:
            echo(f"\nunickpt demo FAILED: {e}")
            return False
    result = _report(cfg, train, resume, train_s, resume_s)
    echo("")
    echo(result.report)
    return result.ok


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = argparse.ArgumentParser(
        prog="demo.py",
        description="Train the toy transformer with FSDP2 on CPU/gloo, checkpoint it, "
        "resume on a different world size and prove the resumed run is "
        "bit-identical to the uninterrupted one.",
    )
    d.add_argument("--out", default="./demo_out", help="folder for the checkpoints (./demo_out)")
    d.add_argument("--steps", type=_positive, default=6, help="steps before the last checkpoint (6)")
    d.add_argument("--save-every", type=_positive, default=2, help="save every N steps (2)")
    d.add_argument(
        "--extra-steps",
        type=_positive,
        default=4,
        help="steps trained after the last checkpoint, and after resuming (4)",
    )
    d.add_argument("--world-size", type=_positive, default=4, help="processes of the first run (4)")
    d.add_argument("--resume-world-size", type=_positive, default=2, help="processes after resuming (2)")
    d.add_argument("--dim", type=_positive, default=130, help="model width (130)")
    d.add_argument("--layers", type=_positive, default=4, help="transformer blocks (4)")
    d.add_argument("--timeout", type=float, default=300.0, help="seconds each phase may take (300)")
    return d


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the demo; exit code 0 when everything matched, 1 otherwise."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.save_every > args.steps:
        parser.error(f"--save-every {args.save_every} is larger than --steps {args.steps}: nothing to resume")
    cfg = DemoConfig(
        out=args.out,
        steps=args.steps,
        save_every=args.save_every,
        extra_steps=args.extra_steps,
        world_size=args.world_size,
        resume_world_size=args.resume_world_size,
        dim=args.dim,
        layers=args.layers,
        timeout_s=args.timeout,
    )
    return 0 if run_demo(cfg) else 1


if __name__ == "__main__":
    sys.exit(main())
