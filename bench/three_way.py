"""Three-way benchmark (issue #30): unickpt vs PyTorch DCP vs Meta's torch-checkpointing vs raw bytes.

One command, every number from the same run:

    PYTHONPATH=src python bench/three_way.py [--gib 1.0] [--rounds 3] [--baseline-src DIR] [--json OUT]
    PYTHONPATH=src python bench/three_way.py --quick          # smoke run: tiny sizes, 1 round

(torch-checkpointing: ``pip install -e '.[bench]'`` or ``make bench-deps``; without it its column
is skipped with a note.)

Workload: FSDP2 at world size 2 on gloo (CPU): ``round(21 * gib)`` x ``Linear(2048, 2048)`` + bias
with AdamW (fp32 params + exp_avg + exp_avg_sq: ~1 GiB at ``--gib 1``), and a separate case of
~20,000 small tensors (6,700 parameters of 48 x 50 + their AdamW state). What each library does
is in ``bench/_three_way_ranks.py``; torch-checkpointing 0.1.1 runs as torchtitan 0.3.0's
``TorchCheckpointingManager`` configures it (async saver, staging copy, TCPStore barrier, a
resharder for model and optimizer; the few changes 0.1.1 needs on a CPU-only ext4 host are listed
in ``tcp_config``), with torchtitan's payload (model state dict, flat optimizer state dict).

Measured, per library, in fresh rank processes per library and per round, rounds interleaved
(unickpt, [unickpt@baseline], DCP, torch-checkpointing, raw, unickpt, ...):

* first save (an async save in a fresh process, call to written: plans, staging buffers, helper
  processes) and blocking save (the second save);
* async save (the third): the call, "training held up" (call + the next training step - a normal
  step) and the time until it is written (durable for unickpt and DCP; torch-checkpointing never
  fsyncs);
* cold load, same layout (the async checkpoint: its snapshot is checked too); resharding load
  2 -> 1 (one process, the blocking checkpoint); 20,000 small tensors save and cold load;
* peak RSS per rank in each (and of the rank's helper processes, e.g. torch-checkpointing's writer);
  the first save's is the async save's staging copy (its buffers are allocated and filled there;
  raw bytes: a blocking write);
* unickpt's load phases (rank 0, from its events, ``save_load.load_phases``), group creation
  (``groups``) included: ~0 for the same-layout load (the process's saves created the groups),
  the whole cost in the resharding load's fresh process.

Raw bytes: each rank ``write``s its local tensors' bytes one after the other into one file and
fsyncs it; loads ``readinto`` the same tensors from those files. Before every load the page cache is
dropped (``sync; echo 3 > /proc/sys/vm/drop_caches`` as root, else ``posix_fadvise(DONTNEED)`` of
the checkpoint's files). Every load is checked bit for bit (CRC32C of every tensor's bytes vs the
values saved); a load that differs, or a session that fails, marks its cell FAILED. Times: barrier,
operation, barrier (rank 0); medians with [min-max] over rounds; ratios of the medians.

``--read-cap GBS`` (root) caps every process's reads from the checkpoints' disk at GBS GB/s
(``bench/_read_cap.py``): a steady disk, where this VM's disk swings 1.2-3 GB/s and a single
reader's rate swings most; with the cap below the disk's rate, the loads' times against the raw
read's say how close each library runs to the disk.

``--baseline-src DIR`` adds "unickpt@baseline": unickpt from another source tree (a checkout or
``git worktree`` of the older commit: ``DIR/src`` or ``DIR`` on its ranks' ``PYTHONPATH``), so before
and after come from the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import GiB, free_port, make_tmp, median, progress, rmtree, table

RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_three_way_ranks.py")
NAMES = {
    "unickpt": "unickpt",
    "unickpt@baseline": "unickpt@baseline",
    "dcp": "DCP",
    "tcp": "torch-checkpointing",
    "raw": "raw bytes",
}
# (row label, key in the rank-0 times, sessions' op); None: a memory row
ROWS = [
    ("first save (fresh process)", "first save"),
    ("blocking save", "blocking save"),
    ("async: call", "async call"),
    ("async: training held up", "async held up"),
    ("async: written (durable)", "async written"),
    ("cold load, same layout", "load"),
    ("resharding load 2 -> 1", "reshard load"),
    ("small tensors: save", "small save"),
    ("small tensors: load", "small load"),
]
MEM_ROWS = [
    ("peak RSS/rank: first save (async: staging copy)", "first save"),
    ("peak RSS/rank: blocking save", "blocking save"),
    ("peak RSS/rank: load", "load"),
    ("peak RSS: resharding load (1 rank)", "reshard load"),
    ("peak RSS/rank: small save", "small save"),
    ("peak RSS/rank: small load", "small load"),
]


def baseline_path(src: str) -> str:
    src = os.path.abspath(src)
    inner = os.path.join(src, "src")
    path = inner if os.path.isdir(os.path.join(inner, "unickpt")) else src
    if not os.path.isdir(os.path.join(path, "unickpt")):
        raise SystemExit(f"--baseline-src {src}: no unickpt package in {src}/src or {src}")
    return path


def run_session(lib: str, session: str, ws: int, cfg: dict, work: str, args: argparse.Namespace) -> list[dict]:
    """Start ``ws`` fresh rank processes of ``lib`` running ``session``; every rank's report, or
    one ``{"error": ...}`` (a rank failed, died or ran past ``--timeout``)."""
    fd, cfg_path = tempfile.mkstemp(prefix=f"{session}-", suffix=".json", dir=work)
    os.close(fd)
    ports = {"port": free_port(), "tcp_port": free_port(), "tcp_port2": free_port()}
    cfg = {**cfg, "lib": lib, "session": session, **ports, "out": cfg_path}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ)
    if lib == "unickpt@baseline":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.baseline, env.get("PYTHONPATH", "")) if p)
    logs = [open(f"{cfg_path}.r{r}.log", "w+") for r in range(ws)]
    procs = [
        subprocess.Popen(
            [sys.executable, RANKS, cfg_path, str(r), str(ws)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for r, log in enumerate(logs)
    ]
    deadline = time.monotonic() + args.timeout
    failed = ""
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                failed = "a rank failed" if time.monotonic() <= deadline else f"timeout {args.timeout} s"
                time.sleep(2)  # let the others write their own error reports first
                break
            time.sleep(0.05)
    finally:  # a failed session, or this run interrupted: no rank (nor its helper processes) outlives it
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    reports = []
    for r, log in enumerate(logs):
        try:
            with open(f"{cfg_path}.r{r}.json") as f:
                reports.append(json.load(f))
        except FileNotFoundError:
            log.seek(0)
            reports.append(
                {
                    "error": f"rank {r}: no report ({failed or 'exit ' + str(procs[r].returncode)}); log:\n"
                    + log.read()[-3000:]
                }
            )
        log.close()
    errors = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if "error" in rep]
    if errors:
        return [{"error": "\n".join(errors)}]
    if lib == "unickpt@baseline" and not reports[0]["unickpt_file"].startswith(args.baseline):
        return [{"error": f"baseline ranks imported {reports[0]['unickpt_file']}, not {args.baseline}"}]
    return reports


def have_tcp() -> bool:
    try:
        from importlib.metadata import version

        return version("torch-checkpointing") is not None
    except Exception:
        return False


def run(args: argparse.Namespace, dump: Any) -> dict:
    """Every round of every library; ``dump(partial)`` after each session (``--json``: a run
    stopped half way still leaves what it measured)."""
    libs = ["unickpt"] + (["unickpt@baseline"] if args.baseline else []) + ["dcp"]
    libs += (["tcp"] if have_tcp() and not args.no_tcp else []) + ["raw"]
    if args.libs:
        libs = [lib for lib in libs if lib in args.libs.split(",")]
    nbytes = args.layers * (args.dim * args.dim + args.dim) * 12
    work = make_tmp(args.dir, 3 * nbytes + 3 * args.params * args.rows * 50 * 12)
    res: dict[str, Any] = {lib: {"times": {}, "mem": {}, "failed": {}} for lib in libs}
    notes: list[str] = (
        [] if "tcp" in libs else ["torch-checkpointing not installed (pip install -e '.[bench]'): skipped"]
    )
    cache_how: set[str] = set()
    base = {"layers": args.layers, "dim": args.dim, "steps": args.steps, "params": args.params, "rows": args.rows}

    def record(lib: str, reps: list[dict], ops: list[str]) -> dict | None:
        if "error" in reps[0]:
            for op in ops:
                res[lib]["failed"].setdefault(op, []).append(reps[0]["error"][-2000:])
            progress(f"  {lib}: FAILED\n{reps[0]['error'][-1500:]}")
            return None
        r0 = reps[0]
        for op, seconds in r0["times"].items():
            res[lib]["times"].setdefault(op, []).append(seconds)
        for rep in reps:
            cache_how.add(rep.get("cache", "") or "")
            notes.extend(n for n in rep.get("notes", []) if n not in notes)
            for op, bad in rep["check"].items():
                if bad:
                    res[lib]["failed"].setdefault(op, []).append(f"not bit-exact: {bad}")
            for op, (before, peak, kids) in rep["mem"].items():
                m = res[lib]["mem"].setdefault(op, [0, 0, 0])
                res[lib]["mem"][op] = [max(m[0], peak), max(m[1], peak - before), max(m[2], kids)]
        for op, phases in r0.get("phases", {}).items():  # unickpt's load phases (rank 0)
            if phases:
                res[lib].setdefault("phases", {}).setdefault(op, []).append(phases)
        dump({"libs": libs, "results": res, "notes": notes, "page_cache": sorted(h for h in cache_how if h)})
        return r0

    try:
        for rnd in range(args.rounds):
            for lib in libs:  # interleaved: each library in turn, fresh processes each time
                progress(f"round {rnd + 1}/{args.rounds}: {lib}")
                tag = f"{lib.replace('@', '-')}-{rnd}"
                dirs = {k: os.path.join(work, f"{tag}-{k}") for k in ("warm", "ckpt", "async", "small")}
                cfg = {**base, "seed": 1000 + rnd, "dirs": dirs}
                merged = args.merge_small and not args.no_small and rnd < args.small_rounds
                big = run_session(lib, "big", 2, {**cfg, "with_small": merged}, work, args)
                ops = ["first save", "blocking save", "async written", "load", "reshard load"]
                ok = record(lib, big, ops + (["small save", "small load"] if merged else []))
                if ok is not None and not args.no_reshard:
                    saved = [r["digests"] for r in big]
                    record(lib, run_session(lib, "reshard", 1, {**cfg, "saved": saved}, work, args), ["reshard load"])
                rmtree(dirs["ckpt"])
                if not args.no_small and rnd < args.small_rounds and not merged:
                    record(lib, run_session(lib, "small", 2, cfg, work, args), ["small save", "small load"])
                for d in dirs.values():
                    rmtree(d)
    finally:
        rmtree(work)
    return {"libs": libs, "results": res, "notes": notes, "page_cache": sorted(h for h in cache_how if h)}


# --------------------------------------------------------------------------------------------
# report


def cell(res: dict, lib: str, op: str) -> str:
    r = res[lib]
    if op in r["failed"]:
        return "FAILED"
    xs = r["times"].get(op)
    if not xs:
        return "-"
    m = median(xs)
    return f"{m:.2f}" if len(xs) == 1 else f"{m:.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def ratio(res: dict, lib: str, ref: str, op: str) -> str:
    if ref not in res or op in res[lib]["failed"] or op in res[ref]["failed"]:
        return "-"
    a, b = res[lib]["times"].get(op), res[ref]["times"].get(op)
    if not a or not b or median(b) <= 0:
        return "-"
    return f"{median(a) / median(b):.2f}x"


def mem_cell(res: dict, lib: str, op: str) -> str:
    m = res[lib]["mem"].get(op)
    if not m:
        return "-"
    out = f"{m[0] / GiB:.2f} (+{m[1] / GiB:.2f})"
    return out + (f" +helpers {m[2] / GiB:.2f}" if m[2] else "")


def report(out: dict, args: argparse.Namespace) -> str:
    libs, res = out["libs"], out["results"]
    header = ["seconds, median [min-max]"] + [NAMES[lib] for lib in libs]
    rows = [[label] + [cell(res, lib, op) for lib in libs] for label, op in ROWS]
    done = [len(res[lib]["times"].get(op, [])) for lib in libs for op in ("load", "small load")]
    rounds = f"{max(done[0::2], default=0)} rounds; small tensors: {max(done[1::2], default=0)}"
    if not out.get("complete", True):
        rounds += f"; STOPPED EARLY (of {args.rounds})"
    text = [table(f"times ({rounds})", header, rows)]
    others = [lib for lib in libs if lib != "unickpt"]
    rows = []
    for label, op in ROWS:
        rows.append(
            [label]
            + [ratio(res, lib, "unickpt", op) for lib in others]
            + [ratio(res, lib, "raw", op) for lib in libs if lib != "raw"]
        )
    hdr = ["ratio of medians"] + [f"{NAMES[lib]}/unickpt" for lib in others]
    hdr += [f"{NAMES[lib]}/raw" for lib in libs if lib != "raw"]
    text.append(table("ratios (> 1: slower than unickpt / than the raw bytes)", hdr, rows))
    rows = [[label] + [mem_cell(res, lib, op) for lib in libs] for label, op in MEM_ROWS]
    text.append(
        table(
            "peak RSS in GiB, max over ranks and rounds (+ growth during the operation)",
            ["memory"] + [NAMES[lib] for lib in libs],
            rows,
        )
    )
    for lib in libs:  # where a unickpt load's time went (rank 0's events: bench/save_load.load_phases)
        for op, runs in res[lib].get("phases", {}).items():
            parts = "  ".join(f"{k}={median([r[k] for r in runs]):.3f}" for k in runs[0])
            text.append(f"{NAMES[lib]} {op}, phases (rank 0, medians, s): {parts}")
    fails = [(lib, op, why) for lib in libs for op, whys in res[lib]["failed"].items() for why in whys]
    loads = sum(len(res[lib]["times"].get(op, [])) for lib in libs for op in ("load", "reshard load", "small load"))
    text.append(
        f"bit-exact: {loads} loads checked, {len(fails)} failure(s); page cache dropped by: "
        f"{', '.join(out['page_cache']) or '-'}"
    )
    text += [f"FAILED {NAMES[lib]} {op}: {why.splitlines()[-1] if why.strip() else why}" for lib, op, why in fails]
    text += out["notes"]
    return "\n\n".join(text)


def markdown(out: dict) -> str:
    libs, res = out["libs"], out["results"]
    lines = ["| | " + " | ".join(NAMES[lib] for lib in libs) + " |", "|---" * (len(libs) + 1) + "|"]
    for label, op in ROWS:
        cells = []
        for lib in libs:
            c = cell(res, lib, op)
            r = ratio(res, lib, "unickpt", op) if lib != "unickpt" and c not in ("-", "FAILED") else ""
            cells.append(f"{c} s ({r})" if r and r != "-" else (f"{c} s" if c not in ("-", "FAILED") else c))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for label, op in MEM_ROWS:
        lines.append(f"| {label} (GiB) | " + " | ".join(mem_cell(res, lib, op) for lib in libs) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="model + AdamW size: round(21 * gib) layers of dim 2048")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=None, help="overrides --gib")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small-rounds", type=int, default=None, help="rounds of the small-tensor case (default --rounds)")
    ap.add_argument("--params", type=int, default=6700, help="small case: parameters (x3 tensors with AdamW)")
    ap.add_argument("--rows", type=int, default=48, help="small case: rows of each (rows x 50) parameter")
    ap.add_argument("--steps", type=int, default=3, help="normal training steps timed before the saves")
    ap.add_argument("--baseline-src", default=None, help="another unickpt source tree: column unickpt@baseline")
    ap.add_argument("--no-tcp", action="store_true", help="leave torch-checkpointing out")
    ap.add_argument("--libs", default=None, help="only these columns, e.g. unickpt,tcp (names as in --json)")
    ap.add_argument("--no-small", action="store_true")
    ap.add_argument("--no-reshard", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 round, --merge-small")
    ap.add_argument(
        "--merge-small", action="store_true", help="run the small case in the big case's processes (fewer start-ups)"
    )
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: the temp folder)")
    ap.add_argument(
        "--read-cap",
        type=float,
        default=None,
        metavar="GBS",
        help="cap the reads of every process from the checkpoints' disk at GBS GB/s (root; bench/_read_cap.py)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="seconds per session before it counts as failed")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    ap.add_argument("--report-from", default=None, help="print the tables of an earlier run's --json file")
    args = ap.parse_args()
    if args.report_from:
        with open(args.report_from) as f:
            data = json.load(f)
        print("\n".join(data["header"]) + "\n\n" + report(data, argparse.Namespace(**data["args"])))
        print("\n" + markdown(data))
        return
    if args.quick:
        args.dim, args.layers, args.params, args.rows, args.rounds, args.steps = 256, 3, 100, 8, 1, 1
        args.merge_small = True
    if args.layers is None:
        args.layers = max(1, round(21 * args.gib))
    args.small_rounds = args.rounds if args.small_rounds is None else args.small_rounds
    args.baseline = baseline_path(args.baseline_src) if args.baseline_src else None
    from _common import machine_line

    size = args.layers * (args.dim * args.dim + args.dim) * 12
    head = [
        f"three-way: FSDP2 ws=2 gloo, {args.layers} x Linear({args.dim}, {args.dim}) + bias + AdamW = "
        f"{size / GiB:.2f} GiB; small case: {args.params} x ({args.rows}x50) + AdamW",
        machine_line(),
    ]
    if args.baseline:
        head.append(f"unickpt@baseline: {args.baseline}")
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # kill: the sessions' clean-up still runs

    def dump(out: dict, complete: bool = False) -> None:
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump({"args": vars(args), "header": head, "complete": complete, **out}, f, indent=1)
            os.replace(args.json + ".tmp", args.json)

    cap: Any = contextlib.nullcontext()
    if args.read_cap:
        from _read_cap import read_cap

        os.makedirs(args.dir or tempfile.gettempdir(), exist_ok=True)
        cap = read_cap(args.dir or tempfile.gettempdir(), int(args.read_cap * 1e9))
    with cap as how:
        head += [how] if how else []
        out = run(args, dump)
    head.append(f"wall time of the whole run: {time.monotonic() - t0:.0f} s")
    dump(out, complete=True)
    print("\n".join(head) + "\n\n" + report(out, args))
    if args.markdown:
        print("\n" + markdown(out))
    failed = any(out["results"][lib]["failed"] for lib in out["libs"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
