"""Training steps while an async save writes in the background, against steps without one (issue #30
item 3): unickpt's writer threads vs its writer process (``SaveOptions(writer="process")``) vs
PyTorch DCP's ``async_save`` (THREAD checkpointer; ``--dcp-process`` adds its PROCESS one).

State and training: ``bench/_common.build_model``: a stack of ``nn.Linear(d, d, bias=False)``
+ Adam, ``--gib`` GiB of fp32 params + exp_avg + exp_avg_sq in total, on CPU. At world size 2:
FSDP2 over gloo (``reshard_after_forward=False``); at world size 1: one gloo rank with a plain
model (no collectives in the step: the save's effect alone). Every rank trains on the same batch,
so every step does the same work.

Each round runs one *window* of ``--every`` steps per method, in a rotating order; a window of
method "none" saves nothing, the others issue one async save before the window's first step (a
fresh folder each). A step *overlaps* the save when it starts before the save is durable (the
commit). Each step's wall time is the slowest rank's, and its CPU time the training thread's own
(``time.thread_time``: background writer threads and processes are not counted, so on a loaded
host it shows the extra work done by the training thread itself). Per method, over all rounds:
  step (none)       median wall time of the steps of "none" windows: the baseline;
  overlap med/p90   median and 90th percentile of the overlapping steps' wall times;
  extra/ckpt        sum over a save's overlapping steps of (step - baseline), median over saves:
                    training time lost to the background write;
  cpu extra/ckpt    the same in the training thread's CPU time;
  blocks            the save call (plus, for DCP, its staging wait before the next step);
  durable           from the call until the save is committed;
  other thr cpu     CPU seconds of the rank process's threads other than the training thread over
                    the window (snapshot copy, writer threads, gloo; "none": the baseline);
  writer proc cpu   CPU seconds of unickpt's writer process over the window (DCP's THREAD
                    checkpointer writes in threads: counted in "other thr cpu");
  first             the first (untimed) save of each method: plan, buffers, DCP's/unickpt's process start.
Every saved checkpoint of the last round is loaded back and checked bit-exact (unickpt) before
the report.

The host may be loaded: compare methods within one run (ratios to "none" and to each other).

Usage (one command, both world sizes):  python bench/step_interference.py [--gib 0.5] [--rounds 4]
    [--every 6] [--world-sizes 2,1] [--dcp-process] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import GiB, barrier, build_model, machine_line, make_tmp, model_shape, progress, rmtree, spawn, table

METHODS = ("none", "unickpt threads", "unickpt process", "DCP thread", "DCP process")


def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*pin_memory.*")


class _Unickpt:
    def __init__(self, writer: str, state: dict, framework: str) -> None:
        import unickpt
        from unickpt.options import SaveOptions

        self.state, self.framework = state, framework
        self.done_at = float("nan")
        self.ckpt = unickpt.Checkpointer(save_options=SaveOptions(writer=writer), listeners=[self._on_event])

    def _on_event(self, ev) -> None:
        if ev.phase == "save.end":
            self.done_at = ev.t_end

    def start(self, path: str):
        self.done_at = float("nan")
        return self.ckpt.save(path, self.state, framework=self.framework, async_save=True)

    def before_step(self, h) -> None:
        pass

    def done(self, h) -> bool:
        return h.done()

    def finish(self, h) -> None:
        h.wait()

    def close(self) -> None:
        self.ckpt.close()


class _DCP:
    def __init__(self, process: bool, model, optim, group) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.model, self.optim, self.group = model, optim, group
        self.kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        # a reused stager (its copies go to storages cached from the previous save); shared memory
        # for the process checkpointer, so the snapshot reaches it without another copy
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=process,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        self.done_at = float("nan")

    def start(self, path: str):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.done_at = float("nan")
        msd, osd = get_state_dict(self.model, self.optim)
        h = dcp.async_save(
            {"model": msd, "optim": osd},
            checkpoint_id=path,
            process_group=self.group,
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )
        self._future(h).add_done_callback(self._done)
        return h

    @staticmethod
    def _future(h):
        return h.upload_completion if hasattr(h, "upload_completion") else h

    def _done(self, _f) -> None:
        self.done_at = time.perf_counter()

    def before_step(self, h) -> None:
        if hasattr(h, "staging_completion"):
            h.staging_completion.result()

    def done(self, h) -> bool:
        return self._future(h).done()

    def finish(self, h) -> None:
        self._future(h).result()

    def close(self) -> None:
        self.stager.close()


def rank_main(rank: int, ws: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    _quiet()
    layers, dim = cfg["layers"], cfg["dim"]
    fsdp2 = ws > 1
    model, optim = build_model(layers, dim, seed=0, fsdp2=fsdp2, reshard_after_forward=False)
    state = {"model": model, "optimizer": optim}
    framework = "fsdp2" if fsdp2 else "torch"
    x = torch.randn(8, dim, generator=torch.Generator().manual_seed(1))

    def step(before_optim=None) -> None:
        loss = model(x).square().mean()
        loss.backward()
        if before_optim is not None:
            before_optim()
        optim.step()
        optim.zero_grad(set_to_none=True)

    for _ in range(cfg["warmup"]):
        step()
    dcp_group = dist.new_group(backend="gloo")
    savers = {
        "unickpt threads": _Unickpt("threads", state, framework),
        "unickpt process": _Unickpt("process", state, framework),
        "DCP thread": _DCP(False, model, optim, dcp_group),
    }
    if cfg["dcp_process"]:
        savers["DCP process"] = _DCP(True, model, optim, dcp_group)
    tmp = cfg["tmp"]
    first: dict[str, float] = {}
    for name, s in savers.items():  # first saves: untimed against training
        path = os.path.join(tmp, "first")
        barrier()
        t0 = time.perf_counter()
        s.finish(s.start(path))
        barrier()
        first[name] = time.perf_counter() - t0
        if rank == 0:
            rmtree(path)
    if rank == 0:
        progress(f"ws={ws}: first saves done {first}")

    order = ["none", *savers]
    saved_state: dict[str, dict] = {}
    windows: list[dict] = []
    for r in range(cfg["rounds"]):
        k = r % len(order)
        for name in order[k:] + order[:k]:
            s = savers.get(name)
            path = os.path.join(tmp, f"r{r}-{name.replace(' ', '_')}")
            if r == cfg["rounds"] - 1 and name.startswith("unickpt"):  # the state this save stands for
                saved_state[name] = _local_model(model)
            barrier()
            h, blocks, t_issue = None, 0.0, float("nan")
            walls, cpus, overlap = [], [], []
            p0, t0_thread, w0_cpu = time.process_time(), time.thread_time(), _writer_cpu(s)
            for i in range(cfg["every"]):
                t0, c0 = time.perf_counter(), time.thread_time()
                if i == 0 and s is not None:
                    t_issue = time.perf_counter()
                    h = s.start(path)
                    blocks = time.perf_counter() - t_issue
                busy = h is not None and not s.done(h)
                step(None if s is None or h is None else lambda: s.before_step(h))  # noqa: B023
                walls.append(time.perf_counter() - t0 - (blocks if i == 0 else 0.0))
                cpus.append(time.thread_time() - c0)
                overlap.append(busy)
            waited = 0.0
            if h is not None:
                w0 = time.perf_counter()
                s.finish(h)
                waited = time.perf_counter() - w0
            durable = (s.done_at - t_issue) if s is not None else float("nan")
            windows.append(
                {
                    "method": name,
                    "round": r,
                    "walls": walls,
                    "cpus": cpus,
                    "overlap": overlap,
                    "blocks": blocks,
                    "durable": durable,
                    "waited": waited,
                    # CPU seconds of this process's other threads (snapshot, writers, gloo) and of
                    # the writer process over the window, until the save is durable
                    "other_cpu": (time.process_time() - p0) - (time.thread_time() - t0_thread),
                    "writer_cpu": _writer_cpu(s) - w0_cpu,
                }
            )
            barrier()
            if rank == 0 and r < cfg["rounds"] - 1:
                rmtree(path)
            barrier()
        if rank == 0:
            progress(f"ws={ws}: round {r + 1} of {cfg['rounds']} done")
    if rank == 0:
        progress(f"ws={ws}: rounds done")
    check = _check_loads(model, framework, tmp, cfg["rounds"] - 1, saved_state)
    for s in savers.values():
        s.close()
    return {"windows": windows, "first": first, "check": check}


def _writer_cpu(saver) -> float:
    """CPU seconds (user + system) the saver's writer process has used so far (0: none)."""
    if not isinstance(saver, _Unickpt):
        return 0.0
    pid = saver.ckpt.resources.staging.writer.pid
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _local_model(model) -> dict:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in model.state_dict().items()}


def _check_loads(model, framework: str, tmp: str, last: int, saved_state: dict[str, dict]) -> str:
    """The last round's unickpt checkpoints load back bit-exact: each holds the model as it was
    at its save call (its optimizer state is saved and loaded the same way)."""
    import torch

    import unickpt

    out = []
    for name, want in saved_state.items():
        with torch.no_grad():  # training is over: load into the model itself (FSDP2 has no deepcopy)
            for p in model.parameters():
                p.zero_()
        unickpt.load(os.path.join(tmp, f"r{last}-{name.replace(' ', '_')}"), {"model": model}, framework=framework)
        got = _local_model(model)
        exact = all(torch.equal(got[k], want[k]) for k in want)
        out.append(f"{name}: {'bit-exact' if exact else 'MISMATCH'}")
        if not exact:
            raise AssertionError(f"{name}: the loaded model differs from the state at the save call")
    return ", ".join(out)


def _median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else float("nan")


def summarize(results: list[dict], ws: int) -> str:
    """One row per method: rank results combined step by step (the slowest rank)."""
    per_rank = [r["windows"] for r in results]
    windows = []
    for ws_windows in zip(*per_rank):
        w0 = ws_windows[0]
        windows.append(
            {
                "method": w0["method"],
                "walls": [max(ws) for ws in zip(*(w["walls"] for w in ws_windows))],
                "cpus": [max(c) for c in zip(*(w["cpus"] for w in ws_windows))],
                "overlap": [any(o) for o in zip(*(w["overlap"] for w in ws_windows))],
                "blocks": max(w["blocks"] for w in ws_windows),
                "durable": max(w["durable"] for w in ws_windows),
                "other_cpu": max(w["other_cpu"] for w in ws_windows),
                "writer_cpu": max(w["writer_cpu"] for w in ws_windows),
            }
        )
    base = _median([t for w in windows if w["method"] == "none" for t in w["walls"]])
    base_cpu = _median([t for w in windows if w["method"] == "none" for t in w["cpus"]])
    rows = []
    for m in METHODS:
        mine = [w for w in windows if w["method"] == m]
        if not mine:
            continue
        if m == "none":
            other = _median([w["other_cpu"] for w in mine])
            rows.append([m, f"{base:.3f}", "", "", "", "", "", "", "", f"{other:.2f}", ""])
            continue
        ov = [t for w in mine for t, o in zip(w["walls"], w["overlap"]) if o]
        extra = [sum(t - base for t, o in zip(w["walls"], w["overlap"]) if o) for w in mine]
        cpu_extra = [sum(c - base_cpu for c, o in zip(w["cpus"], w["overlap"]) if o) for w in mine]
        n_ov = _median([float(sum(w["overlap"])) for w in mine])
        rows.append(
            [
                m,
                "",
                f"{_median(ov):.3f} ({_median(ov) / base:.2f}x)" if ov else "-",
                f"{_p90(ov):.3f}" if ov else "-",
                f"{n_ov:.0f}",
                f"{_median(extra):.3f}",
                f"{_median(cpu_extra):.3f}",
                f"{_median([w['blocks'] for w in mine]):.3f}",
                f"{_median([w['durable'] for w in mine]):.2f}",
                f"{_median([w['other_cpu'] for w in mine]):.2f}",
                f"{_median([w['writer_cpu'] for w in mine]):.2f}",
            ]
        )
    first = results[0]["first"]
    header = [
        "method",
        "step (none)",
        "overlap med",
        "p90",
        "n",
        "extra/ckpt",
        "cpu extra",
        "blocks",
        "durable",
        "other thr cpu",
        "writer proc cpu",
    ]
    out = table(f"world size {ws}: seconds (slowest rank per step)", header, rows)
    out += "\nfirst save (untimed against training): " + ", ".join(f"{k} {v:.2f} s" for k, v in first.items())
    out += "\nload check: " + results[0]["check"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.5, help="total state size (params + Adam), GiB")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--every", type=int, default=6, help="steps per window (a save every this many steps)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--world-sizes", default="2,1")
    ap.add_argument("--dcp-process", action="store_true", help="also DCP's PROCESS async checkpointer")
    ap.add_argument("--dir", default=None, help="parent of the temporary folder (default /tmp)")
    args = ap.parse_args()
    layers, dim = model_shape(args.gib)
    nbytes = layers * dim * dim * 12
    print(machine_line())
    print(f"state {nbytes / GiB:.2f} GiB ({layers} x Linear({dim}, {dim}) + Adam), a save every {args.every} steps")
    for ws in [int(w) for w in args.world_sizes.split(",")]:
        tmp = make_tmp(args.dir, nbytes * 6)
        cfg = {
            "tmp": tmp,
            "layers": layers,
            "dim": dim,
            "rounds": args.rounds,
            "every": args.every,
            "warmup": args.warmup,
            "dcp_process": args.dcp_process,
        }
        try:
            results = spawn(rank_main, ws, cfg, timeout=3600)
        finally:
            rmtree(tmp)
        print(summarize(results, ws), flush=True)


if __name__ == "__main__":
    main()
