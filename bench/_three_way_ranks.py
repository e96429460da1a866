"""The rank processes of bench/three_way.py: one session of one library, in processes of its own.

``bench/three_way.py`` starts ``python bench/_three_way_ranks.py CFG RANK WORLD_SIZE`` once per rank
(with ``PYTHONPATH`` naming the unickpt tree to run, for the ``unickpt@baseline`` column); each
rank joins a gloo group, runs the session named in ``CFG`` (JSON) and writes its report to
``CFG["out"].r<rank>.json``. Only the library under test is imported (and ``unickpt`` only by
its own sessions).

Sessions (``CFG["session"]``):

* ``big``: FSDP2 model (``layers`` x ``Linear(dim, dim)`` + bias, every layer and the root
  ``fully_shard``-ed), AdamW built from ``named_parameters`` (as torchtitan does), one training
  step (creates the optimizer state), ``steps`` timed normal steps; then a first save (an async
  save into ``warm``, waited for: plans, staging buffers, helper processes), a blocking save
  (``ckpt``), a second async save (``async``) followed by the next training step, the wait until
  it is written; then every local tensor is
  overwritten, the page cache dropped, and ``async`` loaded back (same layout), checked bit for
  bit against the values it was saved from (so the async snapshot is checked too).
* ``reshard``: one rank, a world of 1: the same model ``fully_shard``-ed over 1 rank, other
  values, page cache dropped, ``ckpt`` (saved at world size 2) loaded, each tensor's rows checked
  against the saving ranks' digests.
* ``small`` (or at the end of ``big`` with ``with_small``): ``params`` small parameters (``rows``
  x 50, fp32, 100 per ``fully_shard`` unit) +
  AdamW state (~3 tensors each): a save, then a cold load into overwritten tensors, checked.

Libraries (``CFG["lib"]``): ``unickpt`` (also ``unickpt@baseline``), ``dcp`` (``get_state_dict`` +
``dcp.save`` / ``dcp.async_save`` on a gloo group of its own, as torchtitan's "async" mode),
``tcp`` (Meta's torch-checkpointing 0.1.1 configured as torchtitan 0.3.0's
``TorchCheckpointingManager``: see ``tcp_config``), ``raw`` (the same bytes: one ``write`` per
tensor into one file per rank + fsync; ``readinto`` each tensor from it).

Check: a per-tensor CRC32C of the raw bytes (``digests``), taken of the live values before the
save and again after the load: any difference fails the session (``check`` in the report).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import barrier, build_many_small, dcp_load, dcp_save, drop_page_cache, local_tensors, rmtree, scramble

# --------------------------------------------------------------------------------------------
# models


def build_big(layers: int, dim: int, seed: int) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    return model, optim


def build_small(params: int, rows: int, seed: int) -> tuple[Any, Any]:
    return build_many_small(params, rows, seed, named=True)


def train_step(model: Any, optim: Any, x: Any, guard: Any = None) -> None:
    from contextlib import nullcontext

    model(x).square().mean().backward()
    with guard() if guard is not None else nullcontext():
        optim.step()
    optim.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# bit-exact check


def _bytes(t: Any) -> Any:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def digests(model: Any, optim: Any) -> dict[str, list]:
    """``{key: [local shape, dtype, crc32c of the local bytes]}`` of every tensor this rank holds."""
    import crc32c

    return {k: [list(t.shape), str(t.dtype), crc32c.crc32c(_bytes(t))] for k, t in local_tensors(model, optim).items()}


def mismatches(got: dict[str, list], want: dict[str, list]) -> list[str]:
    return [k for k in want if got.get(k) != want[k]] + [k for k in got if k not in want]


def reshard_mismatches(model: Any, optim: Any, saved: list[dict[str, list]]) -> list[str]:
    """Each full tensor (world of 1) against the saving ranks' digests: a tensor every rank
    saved whole (replicated) must equal each; a dim-0 shard of rank r must equal rows
    ``[offset_r, offset_r + rows_r)`` (FSDP2's ``Shard(0)``, ranks in order)."""
    import crc32c

    bad = []
    for k, t in local_tensors(model, optim).items():
        parts = [d.get(k) for d in saved]
        if any(p is None for p in parts):
            bad.append(k)
            continue
        if all(p[0] == list(t.shape) for p in parts):
            ok = all(p == [list(t.shape), str(t.dtype), crc32c.crc32c(_bytes(t))] for p in parts)
        else:
            off, ok = 0, True
            for shape, dtype, crc in parts:
                n = shape[0] if shape else 0
                piece = t[off : off + n]
                ok = ok and [list(piece.shape), str(piece.dtype), crc32c.crc32c(_bytes(piece))] == [shape, dtype, crc]
                off += n
            ok = ok and off == t.shape[0]
        if not ok:
            bad.append(k)
    return bad


# --------------------------------------------------------------------------------------------
# memory


class PeakMem:
    """Samples, every 5 ms, this process's RSS and the summed RSS of its child processes (helper
    writers, e.g. torch-checkpointing's); ``region(label)`` records ``[rss before, peak rss,
    peak children rss]`` in bytes."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self._peak = [0, 0]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.regions: dict[str, list[int]] = {}
        threading.Thread(target=self._run, daemon=True, name="bench-mem").start()

    def _sample(self, kids: list[Any]) -> tuple[int, int]:
        total = 0
        for c in kids:
            try:
                total += c.memory_info().rss
            except Exception:
                pass
        try:
            return self._me.memory_info().rss, total
        except OSError:  # e.g. no descriptor left for /proc: this sample is skipped
            return 0, total

    def _run(self) -> None:
        kids: list[Any] = []
        n = 0
        while not self._stop.wait(0.005):
            if n % 40 == 0:
                kids = self._me.children(recursive=True)
            n += 1
            me, ch = self._sample(kids)
            with self._lock:
                self._peak = [max(self._peak[0], me), max(self._peak[1], ch)]

    def region(self, label: str, fn: Any) -> Any:
        before = self._me.memory_info().rss
        with self._lock:
            self._peak = [before, 0]
        out = fn()
        me, ch = self._sample(self._me.children(recursive=True))
        with self._lock:
            self.regions[label] = [before, max(self._peak[0], me), max(self._peak[1], ch)]
        return out

    def close(self) -> None:
        self._stop.set()


# --------------------------------------------------------------------------------------------
# libraries


def tcp_config(port: int) -> Any:
    """torchtitan 0.3.0's ``torch_checkpointing._default_backend_config()`` for 0.1.1, with what
    0.1.1 needs to run here: ``DefaultResharder`` (0.1.1's name for torchtitan's
    ``DTensorResharder``), a free barrier port instead of 43001, pinned staging only where CUDA
    is (0.1.1 refuses it without), and buffered writes (its default O_DIRECT write stream fails
    with EINVAL on this ext4: unaligned buffers); everything else as torchtitan sets it."""
    import torch
    from torch_checkpointing.barriers import TCPStoreBarrierConfig
    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
    from torch_checkpointing.config import AsyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.schema import ItemSpec
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    resharder = DefaultResharder()
    items = {k: ItemSpec(requires_copy=True, resharder=resharder, required=False) for k in ("model", "optimizer")}
    save = AsyncCheckpointSaverConfig(
        writer_config=CheckpointWriterConfig(
            checkpoint_write_barrier_timeout_sec=600,
            barrier_config=TCPStoreBarrierConfig(
                master_address=os.environ.get("MASTER_ADDR", "localhost"),
                tcpstore_port=port,
                timeout_barrier_init_sec=60,
                use_checkpoint_barrier_tcpstore_libuv=True,
            ),
        ),
        staging_config=CheckpointStagerConfig(use_pinned_memory=torch.cuda.is_available()),
        wait_timeout_secs=600,
    )
    return CheckpointManager.Config(
        items=items,
        default=ItemSpec(requires_copy=False),
        save=save,
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
    )


def _tcp_cpu_gather() -> None:
    """0.1.1 all-gathers its save metadata through CUDA tensors; without CUDA, the same gather
    of the same pickled objects over the gloo group (``all_gather_object``)."""
    import torch
    import torch.distributed as dist
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    if torch.cuda.is_available():
        return

    def gather(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
        out: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    DefaultMetadataManager._all_gather_pickled_data = gather


class Lib:
    """``save(path)`` blocks until written; ``start(path)`` issues an async save and returns an
    object with ``done()``; ``finish(h)`` waits for it; ``guard``: what the next optimizer step
    runs under (None: nothing); ``load(path)`` restores the live model and optimizer."""

    guard: Any = None
    phases: dict | None = None  # unickpt's last load, by phase (``save_load.load_phases``)

    def __init__(self, model: Any, optim: Any, cfg: dict) -> None:
        self.model, self.optim, self.cfg = model, optim, cfg
        self.notes: list[str] = []  # what this run of the library did differently, for the report

    def start(self, path: str) -> Any:
        raise NotImplementedError

    def finish(self, h: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Unickpt(Lib):
    def __init__(self, model: Any, optim: Any, cfg: dict) -> None:
        super().__init__(model, optim, cfg)
        import unickpt
        from _common import EventLog

        # the modules ``import unickpt`` defers to the first call, imported here, outside the
        # timed calls, as the peers' are by this script's imports (an older tree, --baseline-src,
        # may lay them out otherwise: what it lacks is skipped)
        for name in ("unickpt.api", "unickpt.engine.load.pipeline", "unickpt.engine.save.pipeline"):
            with contextlib.suppress(ModuleNotFoundError):
                importlib.import_module(name)
        importlib.import_module("unickpt.frameworks.registry")

        self.u = unickpt
        self.state = {"model": model, "optimizer": optim}
        self.events = EventLog()  # the load's phases (``phases``), for the report

    def save(self, path: str) -> None:
        self.u.save(path, self.state, framework="fsdp2")

    def start(self, path: str) -> Any:
        return self.u.save(path, self.state, framework="fsdp2", async_save=True)

    def finish(self, h: Any) -> None:
        h.wait()

    def load(self, path: str) -> None:
        from save_load import load_phases

        self.events.take()
        cpu = time.process_time()
        self.u.load(path, self.state, framework="fsdp2")
        self.phases = load_phases(self.events.take(), time.process_time() - cpu)

    def close(self) -> None:
        self.u.wait_all()


class DCP(Lib):
    def __init__(self, model: Any, optim: Any, cfg: dict) -> None:
        super().__init__(model, optim, cfg)
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo")  # torchtitan's async mode: a gloo group of its own

    def save(self, path: str) -> None:
        dcp_save(self.model, self.optim, path)

    def start(self, path: str) -> Any:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        return dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=self.group)

    def finish(self, h: Any) -> None:
        h.result()

    def load(self, path: str) -> None:
        dcp_load(self.model, self.optim, path)


class TorchCheckpointing(Lib):
    def __init__(self, model: Any, optim: Any, cfg: dict) -> None:
        super().__init__(model, optim, cfg)
        import resource

        import torch.multiprocessing as torch_mp

        _tcp_cpu_gather()
        tensors = len(local_tensors(model, optim))
        if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2 * tensors + 1024:
            # its shared-memory staging holds a descriptor per tensor: past the open-file limit,
            # torch's own answer (shm files by name instead of descriptors)
            torch_mp.set_sharing_strategy("file_system")
            self.notes.append(f"torch-checkpointing, {tensors} tensors: torch sharing strategy file_system")
        self.mgr = tcp_config(cfg["tcp_port"]).build()
        proc = getattr(getattr(self.mgr, "_saver", None), "_checkpoint_process", None)
        if proc is not None:  # its writer process is started with the manager, at trainer start-up
            proc.wait_for_init()
        self.guard = self.mgr.lock
        try:  # the payload torchtitan gives: model state dict, flat FQN-keyed optimizer state dict
            from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, load_flat_optim_state_dict

            self._flat, self._unflat = get_flat_optim_state_dict, load_flat_optim_state_dict
        except ImportError:
            self._flat, self._unflat = None, None

    def payload(self) -> dict:
        if self._flat is not None:
            return {"model": self.model.state_dict(), "optimizer": self._flat(self.optim)}
        names = {id(p): n for n, p in self.model.named_parameters()}
        flat = {f"state.{names[id(p)]}.{k}": v for p, st in self.optim.state.items() for k, v in st.items()}
        return {"model": self.model.state_dict(), "optimizer": flat}

    def save(self, path: str) -> None:
        self.mgr.save(path, self.payload()).result()

    def start(self, path: str) -> Any:
        return self.mgr.save(path, self.payload())

    def finish(self, h: Any) -> None:
        h.result()

    def load(self, path: str) -> None:
        out = self.mgr.load(path, into=self.payload())
        self.model.load_state_dict(out["model"])
        if self._unflat is not None:
            self._unflat(self.optim, out["optimizer"])

    def close(self) -> None:
        self.mgr.close()


class Raw(Lib):
    """The same bytes without a library: each local tensor in turn, one file per rank."""

    def _file(self, path: str, rank: int | None = None) -> str:
        import torch.distributed as dist

        return os.path.join(path, f"r{dist.get_rank() if rank is None else rank}.bin")

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        fd = os.open(self._file(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in local_tensors(self.model, self.optim).values():
                view = memoryview(_bytes(t))
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, path: str) -> None:
        self._read([self._file(path)], [local_tensors(self.model, self.optim)])

    def load_resharded(self, path: str, saved: list[dict[str, list]]) -> None:
        """One full tensor per key: rank r's file holds its rows of every key, in key order."""
        full = local_tensors(self.model, self.optim)
        pieces: list[dict[str, Any]] = []
        offsets = dict.fromkeys(full, 0)
        for d in saved:
            mine = {}
            for k, (shape, _dtype, _crc) in d.items():
                t = full[k]
                if list(t.shape) == shape:
                    mine[k] = t  # replicated: every rank's copy is read (the same bytes again)
                else:
                    mine[k] = t[offsets[k] : offsets[k] + shape[0]]
                    offsets[k] += shape[0]
            pieces.append(mine)
        self._read([self._file(path, r) for r in range(len(saved))], pieces)

    @staticmethod
    def _read(files: list[str], tensors: list[dict[str, Any]]) -> None:
        for name, ts in zip(files, tensors):
            with open(name, "rb", buffering=0) as f:
                for t in ts.values():
                    view = memoryview(_bytes(t))
                    done = 0
                    while done < len(view):
                        n = f.readinto(view[done:])
                        if not n:
                            raise EOFError(name)
                        done += n


LIBS = {"unickpt": Unickpt, "unickpt@baseline": Unickpt, "dcp": DCP, "tcp": TorchCheckpointing, "raw": Raw}


# --------------------------------------------------------------------------------------------
# sessions


def _timed(fn: Any) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


def _cold(paths: list[str], rank: int) -> str:
    barrier()
    how = drop_page_cache(paths) if rank == 0 else ""
    barrier()
    return how


def session_big(rank: int, cfg: dict) -> dict:
    import torch

    model, optim = build_big(cfg["layers"], cfg["dim"], seed=cfg["seed"])
    x = torch.randn(8, cfg["dim"], generator=torch.Generator().manual_seed(rank))
    train_step(model, optim, x)
    lib = LIBS[cfg["lib"]](model, optim, cfg)
    mem = PeakMem()
    out: dict[str, Any] = {"times": {}, "mem": mem.regions}
    steps = [_timed(lambda: train_step(model, optim, x, lib.guard)) for _ in range(cfg["steps"])]
    out["times"]["step"] = sorted(steps)[len(steps) // 2]
    want = digests(model, optim)
    out["digests"] = want
    d = cfg["dirs"]
    # the first save of a fresh process (plans, staging buffers, helper processes): an async save,
    # issued and waited for, so that the async save timed below is a steady-state one
    first = (lambda: lib.save(d["warm"])) if isinstance(lib, Raw) else (lambda: lib.finish(lib.start(d["warm"])))
    out["times"]["first save"] = mem.region("first save", lambda: _timed(first))
    out["times"]["blocking save"] = mem.region("blocking save", lambda: _timed(lambda: lib.save(d["ckpt"])))
    if cfg["lib"] != "raw":
        done_at = [float("nan")]
        barrier()
        t0 = time.perf_counter()
        h = lib.start(d["async"])
        t_call = time.perf_counter() - t0

        def watch() -> None:  # when the background save is written (polled every 2 ms)
            while not h.done():
                time.sleep(0.002)
            done_at[0] = time.perf_counter()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        train_step(model, optim, x, lib.guard)
        t_step = time.perf_counter() - t0
        lib.finish(h)
        watcher.join()
        barrier()
        out["times"]["async call"] = t_call
        out["times"]["async held up"] = t_step - out["times"]["step"]
        out["times"]["async written"] = done_at[0] - t0
    load_from = d["ckpt"] if cfg["lib"] == "raw" else d["async"]
    scramble(model, optim)
    out["cache"] = _cold([load_from], rank)
    out["times"]["load"] = mem.region("load", lambda: _timed(lambda: lib.load(load_from)))
    out["check"] = {"load": mismatches(digests(model, optim), want)[:5]}
    out["phases"] = {"load": lib.phases}
    out["notes"] = lib.notes
    lib.close()
    mem.close()
    barrier()
    if rank == 0:
        rmtree(d["warm"])
        rmtree(d["async"])
    if cfg.get("with_small"):  # --quick: the small case in these processes too (fewer start-ups)
        del model, optim, lib
        small = session_small(rank, {**cfg, "tcp_port": cfg["tcp_port2"]})
        for k in ("times", "mem", "check"):
            out[k].update(small[k])
        out["notes"] += small["notes"]
    return out


def session_reshard(rank: int, cfg: dict) -> dict:
    import torch

    model, optim = build_big(cfg["layers"], cfg["dim"], seed=cfg["seed"] + 1)
    for p in model.parameters():  # the optimizer state, without a forward and backward
        p.grad = torch.ones_like(p)
    optim.step()
    optim.zero_grad()
    lib = LIBS[cfg["lib"]](model, optim, cfg)
    mem = PeakMem()
    scramble(model, optim)
    path = cfg["dirs"]["ckpt"]
    out: dict[str, Any] = {"cache": _cold([path], rank), "mem": mem.regions}
    if isinstance(lib, Raw):
        fn = lambda: lib.load_resharded(path, cfg["saved"])  # noqa: E731
    else:
        fn = lambda: lib.load(path)  # noqa: E731
    out["times"] = {"reshard load": mem.region("reshard load", lambda: _timed(fn))}
    out["check"] = {"reshard load": reshard_mismatches(model, optim, cfg["saved"])[:5]}
    out["phases"] = {"reshard load": lib.phases}
    lib.close()
    mem.close()
    return out


def session_small(rank: int, cfg: dict) -> dict:
    model, optim = build_small(cfg["params"], cfg["rows"], seed=cfg["seed"])
    lib = LIBS[cfg["lib"]](model, optim, cfg)
    mem = PeakMem()
    want = digests(model, optim)
    path = cfg["dirs"]["small"]
    out: dict[str, Any] = {"times": {}, "mem": mem.regions, "tensors": len(want)}
    out["times"]["small save"] = mem.region("small save", lambda: _timed(lambda: lib.save(path)))
    scramble(model, optim)
    out["cache"] = _cold([path], rank)
    out["times"]["small load"] = mem.region("small load", lambda: _timed(lambda: lib.load(path)))
    out["check"] = {"small load": mismatches(digests(model, optim), want)[:5]}
    out["notes"] = lib.notes
    lib.close()
    mem.close()
    barrier()
    if rank == 0:
        rmtree(path)
    return out


def main() -> None:
    cfg_path, rank, ws = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with open(cfg_path) as f:
        cfg = json.load(f)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(cfg["port"]),
        RANK=str(rank),
        WORLD_SIZE=str(ws),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(ws),
    )
    report = f"{cfg['out']}.r{rank}.json"
    import resource

    # torch-checkpointing's shared-memory staging holds a descriptor per tensor (26,800 in the
    # small case): every library's ranks get a limit above that, as root may set it
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for limit in (1 << 20, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, max(limit, hard)))
            break
        except (OSError, ValueError):
            continue
    try:
        import warnings

        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ws))
        dist.init_process_group("gloo", rank=rank, world_size=ws)
        fn = {"big": session_big, "reshard": session_reshard, "small": session_small}[cfg["session"]]
        out = fn(rank, cfg)
        if cfg["lib"].startswith("unickpt"):
            import unickpt

            out["unickpt_file"] = unickpt.__file__
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        out = {"error": traceback.format_exc()}
    with open(report + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(report + ".tmp", report)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if "error" not in out else 1)


if __name__ == "__main__":
    main()
