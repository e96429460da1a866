"""Fast recovery (issue 40, "Measured"): the RAM tier with replicas on simulated hosts, in one run.

    python bench/recovery.py --quick     # ~64 MiB state, about a minute
    python bench/recovery.py             # 1 GiB state, 3 rounds (several minutes)
    python bench/recovery.py --device cuda --durable-dir /tmp --hosts 2   # bench/gpu_check.sh

``--device cuda``: the state and the training step on the GPU (every simulated host's rank
shares it), so saves copy device to host and loads host to device, and the raw arms add the
copy of the bytes read (pinned) to the GPU. ``--durable-dir``: a local folder as the durable
tier instead of S3 (no root, no network namespace; arm b then restores from that folder).

Set-up (needs root for the S3 tier): ``--hosts`` simulated hosts (default 4), one gloo rank each (``UNICKPT_HOST_ID``
= ``h<rank>``, ``UNICKPT_SHM_ROOT`` = a folder of its own under /dev/shm: its "RAM", a tmpfs);
the state is ``--gib`` GiB of fp32 tensors (16 DTensors sharded by rows over the ranks: each rank
holds 1/hosts of it) plus a small MLP that trains; the durable tier is S3 on SeaweedFS running in
a network namespace of its own behind a ``tc`` token bucket of ``--rate`` on both ends of its veth
pair (``bench/_netns_s3.py``). The tier is ``TieredCheckpointManager("shm://job", "s3://...",
replicas=1, keep_fast=2, durable_every=<the last step>)``.

1. Training held up by a save (rounds of three arms, rotating order, each after filling the state
   with the step's values): ``ram`` = ``tiers.save(step, async_save=True)`` (this host's RAM, then
   replication to the next host in the background); ``disk`` = today's ``unickpt.save(folder on
   the local disk, async_save=True)``; ``none`` = no save. Per arm: the blocking time (the save
   call plus ``wait_snapshot``, slowest rank), the time until the background work ended
   (``tiers.wait()`` / the handle), and the training step times while it ran (the MLP's step,
   every rank), against the ``none`` arm's steps.
   Then the last step is saved and copied to S3 (durable), untimed for the ratios.
2. RAM per host: bytes in each host's folder after the saves, against (1 + replicas) x the host's
   shards x keep_fast.
3. Recovery, rounds of five arms in rotating order (each host's folder reset from a hard-linked
   snapshot taken after the saves, the state zeroed, a new ``TieredCheckpointManager``, then
   ``load_latest`` timed, slowest rank; every load checked bit for bit against the saved values):
     a  peers      host h1's RAM wiped: recovered from the peers' RAM
     b  durable    every host's RAM wiped: the same step from S3 through the limit
     c  intact     every host kept its RAM (a restart after the processes died)
     load          the plain ``unickpt.load`` of the step folder from this host's tmpfs, same
                   layout (after a recovery materialised it)
     nocrc         the same load with ``LoadOptions(verify_checksums=False)`` (what the CRC32C
                   check of every chunk costs)
     raw           ``preadv`` of the same data files from the same tmpfs into a pre-touched
                   buffer, no unickpt
     rawcrc        raw plus ``crc32c`` of the bytes read (the least a verified read costs)
4. Restart (``--restarts`` rounds, arms a, b and c in rotating order): the job restarted as
   torchrun restarts it, in fresh interpreters, one per host (``python bench/recovery.py
   --restart-child``), each host's RAM reset as in 3. Each process marks the wall-clock time
   after ``import torch``, ``import unickpt``, ``init_process_group``, building the job's state
   (its own model: not unickpt's), ``TieredCheckpointManager(...)`` and ``load_latest``; printed
   per step, the slowest host's, from the moment the processes were started (medians over
   rounds). This is what "back in seconds" costs end to end; the interpreters compile unickpt's
   sources where bytecode is not written (``PYTHONDONTWRITEBYTECODE``, as on this VM).
   Bytes by source come from the recovery's report (``last_recovery.bytes_by_source``), the
   load's ``load.read`` events and the veth counter (bytes the S3 server sent).
Ratios printed: b/a (goal >= 5), a/c (goal <= 1.5), load/raw (goal <= 1.2), blocking ram/disk
(goal <= 1), step time during replication / none. Medians over rounds; the machine is shared,
compare within the run.

Cleans up the namespace, qdiscs, server and folders in ``finally`` blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import GiB, fmt_s, free_port, machine_line, median, preadv_files, progress, spawn, table

N_TENSORS = 16
LOST = 1  # the rank whose host loses its RAM in arm a
ARMS_SAVE = ("ram", "disk", "none")
ARMS_LOAD = ("a", "b", "c", "load", "nocrc", "raw", "rawcrc")


# --------------------------------------------------------------------------------------------
# ranks


def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


class _Rank:
    """One rank's state, model, tier options and helpers (module docstring)."""

    def __init__(self, rank: int, ws: int, cfg: dict) -> None:
        import torch
        from torch.distributed.tensor import DTensor, Shard, init_device_mesh

        self.rank, self.ws, self.cfg = rank, ws, cfg
        self.cuda = cfg.get("device", "cpu") == "cuda"
        if self.cuda:  # several simulated hosts may share one GPU
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.ram = _folder(cfg, "ram", rank)
        cols = 1024
        rows = max(1, cfg["bytes"] // (4 * cols * N_TENSORS * ws))
        mesh = init_device_mesh(dev.type, (ws,))
        g = torch.Generator().manual_seed(1000 + rank)
        self.base = [torch.randn(rows, cols, generator=g).to(dev) for _ in range(N_TENSORS)]
        self.local = [torch.empty(rows, cols, device=dev) for _ in range(N_TENSORS)]
        self.module = torch.nn.Module()
        for i, t in enumerate(self.local):
            dt = DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
            self.module.register_parameter(f"w{i:02d}", torch.nn.Parameter(dt, requires_grad=False))
        self.state = {"model": self.module}
        self.local = [p.to_local() for p in self.module.parameters()]  # the tensors saved and loaded into
        self.shard_bytes = sum(t.numel() * 4 for t in self.local)
        torch.manual_seed(7)
        d = cfg["mlp"]
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d)).to(dev)
        self.opt = torch.optim.Adam(self.mlp.parameters(), lr=1e-4)
        self.x = torch.randn(64, d, device=dev)

    def tiers(self):
        import unickpt

        return unickpt.TieredCheckpointManager(
            "shm://job", self.cfg["durable"], replicas=1, keep_fast=2, durable_every=self.cfg["last"],
            chunk_bytes=self.cfg["chunk"], flush_on_sigterm=False, timeout=1200.0,
        )  # fmt: skip

    def fill(self, step: int) -> None:
        import torch

        for b, t in zip(self.base, self.local):
            torch.add(b, float(step), out=t)

    def exact(self, step: int | None) -> bool:
        import torch

        if step is None:
            return False
        return all(
            torch.equal(getattr(self.module, f"w{i:02d}").to_local(), torch.add(b, float(step)))
            for i, b in enumerate(self.base)
        )

    def train_step(self) -> float:
        import torch

        t0 = time.perf_counter()
        self.mlp(self.x).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _save_arm(r: _Rank, arm: str, step: int, tiers) -> dict:
    """One window of arm ``arm``: the save (or none), then training steps until it is done."""
    import unickpt

    r.fill(step)
    _barrier()
    done = threading.Event()
    took: dict = {}
    t0 = time.perf_counter()
    if arm == "ram":
        h = tiers.save(step, r.state, async_save=True)
    elif arm == "disk":
        h = unickpt.save(os.path.join(r.cfg["disk"], f"step_{step}"), r.state, async_save=True)
    if arm != "none":
        h.wait_snapshot()
    took["block"] = time.perf_counter() - t0

    def waiter() -> None:
        try:
            tiers.wait() if arm == "ram" else h.wait()
        finally:
            took["background"] = time.perf_counter() - t0
            done.set()

    steps = []
    if arm == "none":
        steps = [r.train_step() for _ in range(r.cfg["none_steps"])]
    else:
        th = threading.Thread(target=waiter)
        th.start()
        while not done.is_set():
            steps.append(r.train_step())
        th.join()
    took["steps"] = steps
    _barrier()
    if arm == "disk" and r.rank == 0:
        shutil.rmtree(os.path.join(r.cfg["disk"], f"step_{step}"), ignore_errors=True)
    return took


def _ram_bytes(folder: str) -> dict:
    out = {"primary": 0, "replica": 0, "other": 0}
    for top, _, files in os.walk(folder):
        for f in files:
            n = os.path.getsize(os.path.join(top, f))
            rel = os.path.relpath(os.path.join(top, f), folder).split(os.sep)
            if "replicas" in rel:
                out["replica"] += n
            elif any(p.startswith("step_") for p in rel) and "data" in rel:
                out["primary"] += n
            else:
                out["other"] += n
    return out


def _folder(cfg: dict, kind: str, rank: int) -> str:
    """Host ``rank``'s folder of ``kind``: "ram" (its RAM: ``UNICKPT_SHM_ROOT``), "snap" (that
    RAM right after the saves) or "mat" (... after a recovery materialised the step)."""
    return os.path.join(cfg["base"], kind, f"h{rank}")


def _host_env(cfg: dict, rank: int) -> dict:
    """The environment that makes a process host ``rank`` of the simulated job."""
    return {**cfg["s3env"], "UNICKPT_HOST_ID": f"h{rank}", "UNICKPT_SHM_ROOT": _folder(cfg, "ram", rank)}


def _reset(cfg: dict, rank: int, arm: str) -> None:
    """Host ``rank``'s RAM for arm ``arm``: wiped (a: host h1; b: every host), else the snapshot
    (hard links: nothing copied; the recovery never writes into an existing file)."""
    ram = _folder(cfg, "ram", rank)
    shutil.rmtree(ram, ignore_errors=True)
    if arm == "b" or (arm == "a" and rank == LOST):
        return
    kept = _folder(cfg, "mat" if arm in ("load", "nocrc", "raw", "rawcrc") else "snap", rank)
    shutil.copytree(kept, ram, copy_function=os.link)


def _rx(r: _Rank) -> int:
    if r.cfg["rx"] is None:  # a local durable tier (--durable-dir): no link to count
        return 0
    with open(r.cfg["rx"]) as f:
        return int(f.read())


def _load_arm(r: _Rank, arm: str, log) -> dict:
    import torch

    import unickpt

    _barrier()
    _reset(r.cfg, r.rank, arm)
    for t in r.local:
        t.zero_()
    _barrier()
    out: dict = {}
    last = r.cfg["last"]
    if arm in ("a", "b", "c"):
        tiers = r.tiers()
        log.take()
        rx0 = _rx(r)
        _barrier()
        t0 = time.perf_counter()
        step = tiers.load_latest(r.state)
        out["wall"] = time.perf_counter() - t0
        rep = tiers.last_recovery
        t1 = time.perf_counter()
        tiers.wait()  # a lost host's files written back into its RAM (background work after the load)
        out["after"] = time.perf_counter() - t1
        tiers.close()
        out.update(tier=rep.tier, sources=dict(rep.bytes_by_source), by_host=dict(rep.peer_bytes_by_host),
                   failed=list(rep.failed_copies), fed=getattr(rep, "fed_bytes", 0))  # fmt: skip
        _barrier()
        out["rx"] = _rx(r) - rx0
    elif arm in ("load", "nocrc"):
        opts = unickpt.LoadOptions(verify_checksums=arm == "load")
        log.take()
        _barrier()
        t0 = time.perf_counter()
        unickpt.load(r.cfg["step_url"], r.state, options=opts)
        out["wall"] = time.perf_counter() - t0
        step = last
    else:  # raw, rawcrc: this rank's data files of the step, from this host's tmpfs
        folder = os.path.join(r.ram, f"unickpt-{os.getuid()}", "job", r.cfg["stepdir"], "data")
        mine = sorted(
            os.path.join(top, f) for top, _, files in os.walk(folder) for f in files if f.startswith(f"r{r.rank:05d}-")
        )
        sizes = [os.path.getsize(p) for p in mine]
        # touched: no page faults inside the clock; on CUDA pinned, then copied to the GPU
        buf = torch.ones(sum(sizes), dtype=torch.uint8, pin_memory=r.cuda)
        view = memoryview(buf.numpy()).cast("B")
        gpu = torch.empty_like(buf, device="cuda") if r.cuda else None
        _barrier()
        t0 = time.perf_counter()
        at = preadv_files(mine, sizes, view, (64 << 20) if arm == "rawcrc" else 0)
        if gpu is not None:
            gpu.copy_(buf, non_blocking=True)
            torch.cuda.synchronize()
        out["wall"] = time.perf_counter() - t0
        out["raw_bytes"] = at
        del view, buf
        step = last
    events = log.take()
    out["read"] = sum(e.nbytes for e in events if e.phase == "load.read")
    out["phases"] = {e.phase: e.seconds for e in events if e.phase.startswith("load.")}
    out["exact"] = True if arm.startswith("raw") else r.exact(step)
    out["step"] = step
    _barrier()
    return out


def rank_main(rank: int, ws: int, cfg: dict) -> dict | None:
    os.environ.update(_host_env(cfg, rank))
    _quiet()
    import torch

    torch.set_num_threads(1)
    import unickpt
    import unickpt.engine.load.pipeline  # noqa: F401  imported before any clock
    from _common import EventLog

    r = _Rank(rank, ws, cfg)
    log = EventLog()
    res: dict = {"shard_bytes": r.shard_bytes, "save": [], "load": []}

    # 1. saves: rounds of ram / disk / none, rotating; step 1 is a warm-up
    tiers = r.tiers()
    for _ in range(3):
        r.train_step()
    for rnd in range(cfg["rounds"] + 1):
        order = ARMS_SAVE[rnd % 3 :] + ARMS_SAVE[: rnd % 3]
        for arm in order:
            took = _save_arm(r, arm, rnd + 1, tiers)
            if rnd:
                res["save"].append({"round": rnd, "arm": arm, **took})
        if rank == 0:
            progress(f"save round {rnd}: done")
    last = cfg["last"]
    r.fill(last)
    t0 = time.perf_counter()
    tiers.save(last, r.state, async_save=True).wait_snapshot()
    tiers.wait()
    res["durable_save"] = time.perf_counter() - t0
    cfg["step_url"] = tiers.fast.path_for(last)
    cfg["stepdir"] = os.path.basename(cfg["step_url"])
    tiers.close()
    _barrier()
    if rank == 0:
        progress(f"step {last} saved to RAM, replicated and copied to the durable tier in {res['durable_save']:.1f} s")

    # 2. RAM per host
    res["ram"] = _ram_bytes(r.ram)

    # 3. recovery: snapshot, one untimed recovery (materialises the step: the "load"/"raw" arms' files)
    shutil.copytree(r.ram, _folder(cfg, "snap", rank), copy_function=os.link)
    _barrier()
    warm = _load_arm(r, "c", log)
    assert warm["exact"], warm
    shutil.copytree(r.ram, _folder(cfg, "mat", rank), copy_function=os.link)
    for rnd in range(cfg["rounds"]):
        k = rnd % len(ARMS_LOAD)
        for arm in ARMS_LOAD[k:] + ARMS_LOAD[:k]:
            out = _load_arm(r, arm, log)
            if not out["exact"]:
                raise AssertionError(f"rank {rank}: arm {arm} round {rnd} did not restore step {last} bit for bit")
            res["load"].append({"round": rnd, "arm": arm, **out})
            if rank == 0:
                progress(f"load round {rnd} {arm}: {out['wall']:.3f} s")
    every = _gather(res)
    return every if rank == 0 else None


# --------------------------------------------------------------------------------------------
# 4. restarts in fresh processes

MARKS = ("torch", "unickpt", "group", "state", "manager", "loaded")


def restart_child(spec: dict) -> None:
    """One host's process of the restarted job (``--restart-child``): its marks to ``spec["out"]``."""
    marks = {}
    import torch

    marks["torch"] = time.time()
    import unickpt  # noqa: F401  # after torch, as a job imports it

    marks["unickpt"] = time.time()
    import torch.distributed as dist

    _quiet()
    rank, ws = spec["rank"], spec["ws"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=ws)
    marks["group"] = time.time()
    torch.set_num_threads(1)
    r = _Rank(rank, ws, spec["cfg"])
    marks["state"] = time.time()
    tiers = r.tiers()
    marks["manager"] = time.time()
    step = tiers.load_latest(r.state)
    marks["loaded"] = time.time()
    out = {"marks": marks, "exact": r.exact(step), "tier": tiers.last_recovery.tier}
    tiers.wait()
    tiers.close()
    dist.destroy_process_group()
    with open(spec["out"], "w") as f:
        json.dump(out, f)


def restart(cfg: dict, hosts: int, arm: str) -> dict:
    """Arm ``arm`` of 4: every host's RAM reset (as ``_reset``), then the job's processes started
    at once; returns the slowest host's seconds from their start to each mark."""
    for h in range(hosts):
        _reset(cfg, h, arm)
    port, procs, outs = free_port(), [], []
    t0 = time.time()
    for h in range(hosts):
        env = {**os.environ, **_host_env(cfg, h), "OMP_NUM_THREADS": "1"}
        outs.append(os.path.join(cfg["base"], f"restart-h{h}.json"))
        spec = {"cfg": cfg, "rank": h, "ws": hosts, "port": port, "out": outs[-1]}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--restart-child", json.dumps(spec)],
                                      env=env))  # fmt: skip
    for p in procs:
        if p.wait(timeout=1200) != 0:
            raise SystemExit(f"a restarted host's process failed (exit {p.returncode})")
    got = []
    for path in outs:
        with open(path) as f:
            got.append(json.load(f))
    if not all(g["exact"] for g in got):
        raise AssertionError(f"restart arm {arm}: a host did not restore the step bit for bit")
    return {"tier": got[0]["tier"], **{m: max(g["marks"][m] for g in got) - t0 for m in MARKS}}


# --------------------------------------------------------------------------------------------
# report


def report_restarts(runs: list[tuple[str, dict]], durable_kind: str) -> None:
    rows, total = [], {}
    for arm, label in (("a", "a peers (h1 lost)"), ("b", f"b durable {durable_kind}"), ("c", "c intact")):
        mine = [r for a, r in runs if a == arm]
        med = {m: median([r[m] for r in mine]) for m in MARKS}
        total[arm] = med["loaded"]
        steps = [med["torch"]] + [med[b] - med[a] for a, b in zip(MARKS, MARKS[1:])]
        rows.append([label, *(f"{s:.2f}" for s in steps), f"{med['loaded']:.2f}", mine[0]["tier"]])
    print(table("a restart in fresh processes: seconds per step, slowest host, from the processes' start (medians)",
                ["arm", "import torch", "import unickpt", "process group", "job's state", "manager",
                 "load_latest", "total", "tier"], rows))  # fmt: skip
    print(
        f"restart from the durable tier / from peers (b / a) = {total['b'] / total['a']:.2f}; "
        f"from peers / intact (a / c) = {total['a'] / total['c']:.2f}"
    )


def report(ranks: list[dict], cfg: dict, extra: str) -> None:
    hosts = len(ranks)
    state_bytes = sum(r["shard_bytes"] for r in ranks)
    print(machine_line())
    print(extra)
    print(f"state: {state_bytes / GiB:.3f} GiB fp32 ({N_TENSORS} DTensors) on {hosts} simulated hosts x 1 rank; "
          f"replicas=1, keep_fast=2, chunk {cfg['chunk'] >> 20} MiB; {cfg['rounds']} rounds\n")  # fmt: skip

    # saves
    rows, med = [], {}
    for arm in ARMS_SAVE:
        per_round = {}
        for r in ranks:
            for s in r["save"]:
                if s["arm"] == arm:
                    per_round.setdefault(s["round"], []).append(s)
        block = [max(x["block"] for x in v) for v in per_round.values()]
        back = [max(x["background"] for x in v) for v in per_round.values()] if arm != "none" else []
        steps = [t for v in per_round.values() for x in v for t in x["steps"]]
        med[arm] = (median(block), median(back), median(steps))
        rows.append([arm, fmt_s(median(block)) if arm != "none" else "-", fmt_s(median(back)),
                     len(steps), f"{median(steps) * 1e3:.1f}"])  # fmt: skip
    print(table("training held up by a save (slowest rank; medians over rounds)",
                ["arm", "blocking s", "background s", "steps", "step ms (median)"], rows))  # fmt: skip
    print(f"blocking ram / disk = {med['ram'][0] / med['disk'][0]:.2f} (goal <= 1)")
    print(f"step time during replication / without a save = {med['ram'][2] / med['none'][2]:.2f}; "
          f"during the disk save / without = {med['disk'][2] / med['none'][2]:.2f}")  # fmt: skip
    print(f"last step: RAM + replication + durable copy: {ranks[0]['durable_save']:.1f} s\n")

    # RAM
    rows = []
    for i, r in enumerate(ranks):
        got = sum(r["ram"].values())
        want = 2 * r["shard_bytes"] * 2
        rows.append([f"h{i}", f"{r['ram']['primary'] / 2**20:.1f}", f"{r['ram']['replica'] / 2**20:.1f}",
                     f"{r['ram']['other'] / 2**20:.2f}", f"{got / 2**20:.1f}", f"{want / 2**20:.1f}",
                     f"{got / want:.3f}"])  # fmt: skip
    print(table("RAM per host after the saves (MiB): (1 + replicas) x its shards x keep_fast",
                ["host", "primaries", "replicas", "other", "total", "expected", "ratio"], rows))  # fmt: skip
    print()

    # loads
    rows, med_l = [], {}
    labels = {"a": "a peers (h1 lost)", "b": f"b durable {cfg['durable_kind']}", "c": "c intact",
              "load": "load (tmpfs)", "nocrc": "load, no CRC check", "raw": "raw preadv (tmpfs)",
              "rawcrc": "raw preadv + crc32c"}  # fmt: skip
    for arm in ARMS_LOAD:
        per_round = {}
        for r in ranks:
            for s in r["load"]:
                if s["arm"] == arm:
                    per_round.setdefault(s["round"], []).append(s)
        walls = [max(x["wall"] for x in v) for v in per_round.values()]
        med_l[arm] = median(walls)
        first = next(iter(per_round.values()))
        src = first[0].get("sources", {})
        read = sum(x["read"] for x in first) + sum(x.get("raw_bytes", 0) for x in first)
        rx = first[0].get("rx", 0)
        rows.append([labels[arm], fmt_s(med_l[arm]), f"{min(walls):.3f}-{max(walls):.3f}",
                     f"{src.get('local', 0) / 2**20:.0f}", f"{src.get('peer', 0) / 2**20:.0f}",
                     f"{read / 2**20:.0f}", f"{rx / 2**20:.0f}", first[0].get("tier", "-")])  # fmt: skip
    print(table("recovery of the last step (load wall, slowest rank; bytes in MiB, first round)",
                ["arm", "median s", "range", "own RAM", "peers", "load read", "S3 wire", "tier"], rows))  # fmt: skip
    print(f"durable {cfg['durable_kind']} / peers (b / a) = {med_l['b'] / med_l['a']:.2f} (goal >= 5 for S3)")
    print(f"peers / intact (a / c) = {med_l['a'] / med_l['c']:.2f} (goal <= 1.5)")
    fed = [s for r in ranks for s in r["load"] if s["arm"] == "a"]
    after = median([max(x["after"] for x in fed if x["round"] == k) for k in {x["round"] for x in fed}])
    print(f"a: {fed[0]['fed'] / 2**20:.0f} MiB read by the load "
          f"straight from peers; written back into the lost host's RAM after load_latest in {after:.3f} s "
          "(background, median)")  # fmt: skip
    print(f"load / raw preadv from tmpfs = {med_l['load'] / med_l['raw']:.2f} (goal <= 1.2); "
          f"intact recovery / raw = {med_l['c'] / med_l['raw']:.2f}")  # fmt: skip
    print(f"load / (raw preadv + crc32c) = {med_l['load'] / med_l['rawcrc']:.2f}; "
          f"load without CRC check / raw = {med_l['nocrc'] / med_l['raw']:.2f}")  # fmt: skip
    phases = {}
    for r in ranks:
        for s in r["load"]:
            for k, v in s["phases"].items():
                phases.setdefault((s["arm"], k), []).append(v)
    for arm in ("c", "load"):
        parts = ", ".join(f"{k[len('load.') :]} {median(v):.3f}" for (a, k), v in sorted(phases.items()) if a == arm)
        print(f"  {arm}: load phases (median over ranks and rounds, s): {parts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB state, 3 rounds (about a minute)")
    ap.add_argument("--gib", type=float, default=None, help="state size (default 1, --quick 1/16)")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", default="1gbit", help="tc rate of the S3 server's link")
    ap.add_argument("--chunk-mib", type=int, default=16, help="the tier's chunk (replication, CRC32C; library default)")
    ap.add_argument("--mlp", type=int, default=512, help="width of the training step's MLP")
    ap.add_argument("--dir", default=None, help="local disk folder for the disk arm (default /tmp)")
    ap.add_argument("--restarts", type=int, default=2, help="rounds of 4. (0: none)")
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives (cuda: the GPU check)"
    )
    ap.add_argument("--durable-dir", default=None, help="a local folder as the durable tier, not S3 behind tc")
    ap.add_argument("--restart-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.restart_child is not None:
        restart_child(json.loads(args.restart_child))
        return
    gib = args.gib if args.gib is not None else (1 / 16 if args.quick else 1.0)
    base = tempfile.mkdtemp(prefix="unickpt-recbench-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="unickpt-recbench-", dir=args.dir)
    t_start = time.monotonic()
    runs: list[tuple[str, dict]] = []
    cfg = {
        "base": base, "disk": disk, "bytes": int(gib * GiB), "rounds": args.rounds, "last": args.rounds + 2,
        "chunk": args.chunk_mib << 20, "mlp": args.mlp, "none_steps": 20, "device": args.device,
    }  # fmt: skip
    try:
        with contextlib.ExitStack() as stack:
            if args.durable_dir is not None:
                durable = tempfile.mkdtemp(prefix="unickpt-recbench-durable-", dir=args.durable_dir)
                stack.callback(shutil.rmtree, durable, ignore_errors=True)
                cfg.update(durable=durable, s3env={}, rx=None, durable_kind="local folder")
                extra = f"durable tier: the local folder {durable}"
            else:
                from _netns_s3 import LimitedS3

                s3 = stack.enter_context(LimitedS3(args.rate))
                bucket = s3.server.create_bucket("rec")
                cfg.update(durable=f"s3://{bucket.name}/job", s3env=s3.server.endpoint.env(),
                           rx=f"/sys/class/net/{s3.host_if}/statistics/rx_bytes", durable_kind="S3")  # fmt: skip
                extra = f"S3: SeaweedFS in netns {s3.ns} behind tc ({s3.qdiscs()})"
                progress(f"S3 server up at {s3.server.endpoint.url}")
            progress(f"starting {args.hosts} ranks, state on {args.device}")
            ranks = spawn(rank_main, args.hosts, cfg, timeout=7200, threads=1)[0]
            for rnd in range(args.restarts):
                for arm in ("a", "b", "c")[rnd % 3 :] + ("a", "b", "c")[: rnd % 3]:
                    runs.append((arm, restart(cfg, args.hosts, arm)))
                    progress(f"restart round {rnd} {arm}: {runs[-1][1]['loaded']:.2f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    report(ranks, cfg, extra)
    if runs:
        print()
        report_restarts(runs, cfg["durable_kind"])
    print(f"\n(total {time.monotonic() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
