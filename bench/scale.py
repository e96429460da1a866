"""Planning at scale, simulated in one process from synthetic shard specs (no tensors, no I/O).

Layouts
- ``fsdp``: a Llama-70B-like model (723 parameters: 80 layers x 9 + embeddings, final norm,
  head; GQA) with AdamW state (exp_avg, exp_avg_sq and a 0-d step per parameter, as FSDP2 keeps
  it: replicated on every rank), each tensor ``Shard(0)`` over N ranks (torch.chunk sizes).
- ``megatron``: a Llama-405B-like model (126 layers, hidden 16384, FFN 53248, vocab 128256) at
  TP=8, PP=16, DP=N/128 (8,960 ranks = DP 70, the ByteCheckpoint paper's run): QKV and FC1
  column-parallel (dim 0 over TP), proj and FC2 row-parallel (dim 1 over TP), norms replicated
  over TP; model and Adam state replicated over DP (the non-distributed optimizer).

Figures, per layout and world size (``--ranks``):
- local plan: time to build and encode one rank's ``LocalSavePlan`` (per rank, its own
  shards), its encoded size (``planning.save.wire``) and the bytes the coordinator gathers
  (all ranks); the coordinator keeps only these bytes, as ``plan_stage`` does;
- global plan: ``plan_save`` on the gathered bytes (decode, dedup, worst-fit, byte layout) at
  the coordinator, and the encoding of every rank's part for the scatter;
- per rank: the bytes of its own part of the global plan (what it receives), and the cached
  re-plan (``CachedPlan.next``: the new save id on its own part);
- metadata: ``build_metadata`` + encode time, size, decode time (every rank decodes it at load);
- load: ``plan_local_load`` of one rank of a resharded job (FSDP at 4,800 ranks / Megatron at
  TP 8 PP 8); every rank of the new job's needs (each rank plans its load; this takes the
  simulation minutes: "needs s"), the coordinator's read assignment over all of them
  (``engine.load.exchange.read_parts``: counts, disjoint rows, segments, readers, batches, each
  rank's part, columnar), the bytes a rank sends (its needs) and receives (its part), the time
  it decodes its part, and what the earlier all_gather of every rank's needs delivered to each
  rank;
- coordinator peak memory (the peak RSS of the process, which measures one world size).
Growth exponents between consecutive world sizes: 0 = flat per rank, 1 = linear.

Run: ``python bench/scale.py`` (FSDP at 256 and 1,024 ranks, a few minutes on 2 cores);
``--ranks 256,1024,4096 --layouts fsdp,megatron`` for the issue's full set (long).
``--freeze-gc``: the single timed load-planning calls otherwise include whatever full garbage
collection (a walk over every decoded metadata record) happens to fall into them.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from unickpt.engine.gc_pause import gc_paused
from unickpt.engine.load.exchange import read_parts
from unickpt.engine.plan_cache import CachedPlan, checksum_chunk_of
from unickpt.format.build import SaveSource, build_metadata
from unickpt.format.codec import decode_metadata, encode_metadata
from unickpt.planning.load.assign import decode_part, report_needs
from unickpt.planning.load.overlap import plan_local_load
from unickpt.planning.load.runs import extents_of
from unickpt.planning.save.model import LocalSavePlan
from unickpt.planning.save.plan import plan_save
from unickpt.planning.save.wire import LocalPlans, decode_rank_plan, encode_local_plan, encode_rank_rows
from unickpt.planning.specs import ShardSpec

Shape = tuple[int, ...]


# ------------------------------------------------------------------ layouts


def llama_params(layers: int, hidden: int, ffn: int, vocab: int, kv: int) -> list[tuple[str, Shape]]:
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (ffn, hidden)),
            (p + "mlp.up_proj.weight", (ffn, hidden)),
            (p + "mlp.down_proj.weight", (hidden, ffn)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


FSDP_70B = llama_params(80, 8192, 28672, 128256, 1024)  # 723 parameters


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk's piece ``i`` of ``n`` rows in ``parts``: (offset, length)."""
    size = -(-n // parts)
    lo = min(n, i * size)
    return lo, min(n, lo + size) - lo


def fsdp_local(rank: int, world: int) -> LocalSavePlan:
    specs = []
    for fqn, shape in FSDP_70B:
        off, n = _chunk(shape[0], world, rank)
        box = ((off, *([0] * (len(shape) - 1))), (n, *shape[1:]))
        name = fqn[len("model.") :] if fqn.startswith("model.") else fqn
        specs.append(ShardSpec(f"model.{name}", "bfloat16", shape, *box))
        for state in ("exp_avg", "exp_avg_sq"):
            specs.append(ShardSpec(f"optimizer.state.{name}.{state}", "float32", shape, *box))
        specs.append(ShardSpec(f"optimizer.state.{name}.step", "float32", (), (), ()))
    return LocalSavePlan(rank, tuple(specs))


MEGATRON_405B_LAYERS, MEGATRON_HIDDEN, MEGATRON_FFN, MEGATRON_VOCAB, MEGATRON_KV = 126, 16384, 53248, 128256, 1024


def megatron_local(rank: int, world: int, tp: int = 8, pp: int = 16) -> LocalSavePlan:
    tp_rank, pp_rank = rank % tp, (rank // tp) % pp
    h, f = MEGATRON_HIDDEN, MEGATRON_FFN
    qkv = h + 2 * MEGATRON_KV
    per_stage = -(-MEGATRON_405B_LAYERS // pp)
    layers = range(pp_rank * per_stage, min(MEGATRON_405B_LAYERS, (pp_rank + 1) * per_stage))
    params: list[tuple[str, Shape, int | None]] = []  # (name, global shape, split dim or None)
    if pp_rank == 0:
        params.append(("embedding.word_embeddings.weight", (MEGATRON_VOCAB, h), 0))
    for i in layers:
        p = f"decoder.layers.{i}."
        params += [
            (p + "self_attention.linear_qkv.weight", (qkv, h), 0),
            (p + "self_attention.linear_qkv.layer_norm_weight", (h,), None),
            (p + "self_attention.linear_proj.weight", (h, h), 1),
            (p + "mlp.linear_fc1.weight", (2 * f, h), 0),
            (p + "mlp.linear_fc1.layer_norm_weight", (h,), None),
            (p + "mlp.linear_fc2.weight", (h, f), 1),
        ]
    if pp_rank == pp - 1:
        params += [("decoder.final_layernorm.weight", (h,), None), ("output_layer.weight", (MEGATRON_VOCAB, h), 0)]
    specs = []
    for name, shape, dim in params:
        offs, lens = [0] * len(shape), list(shape)
        if dim is not None:
            size = shape[dim] // tp
            offs[dim], lens[dim] = tp_rank * size, size
        box = (tuple(offs), tuple(lens))
        specs.append(ShardSpec(f"model.{name}", "bfloat16", shape, *box))
        for state in ("exp_avg", "exp_avg_sq"):
            specs.append(ShardSpec(f"optimizer.state.{name}.{state}", "float32", shape, *box))
    return LocalSavePlan(rank, tuple(specs))


LAYOUTS: dict[str, Callable[[int, int], LocalSavePlan]] = {"fsdp": fsdp_local, "megatron": megatron_local}


def load_targets(layout: str, rank: int, world: int) -> list[ShardSpec]:
    """The shards one rank of the resharded job loads: FSDP at ``world`` ranks, or Megatron at
    TP 8 / PP 8 (the stage boundaries move)."""
    if layout == "fsdp":
        return list(fsdp_local(rank, world).shards)
    return list(megatron_local(rank, world, tp=8, pp=8).shards)


# ------------------------------------------------------------------ measurement


def _keys(md: Any, layout: str, r: int, world: int) -> list[tuple[str, int]]:
    """The shards rank ``r`` of the new job reports, in its report's order."""
    return [(x.fqn, x.shard_index) for x in plan_local_load(md, load_targets(layout, r, world))]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(layout: str, world: int, load_world: int, freeze_gc: bool = False, chunk_mib: int = 0) -> dict[str, float]:
    make = LAYOUTS[layout]
    mid = world // 2
    # every rank builds and encodes its local plan (its own shards); the coordinator gets bytes
    t_local = time.perf_counter()
    encoded = []
    for r in range(world):
        plan = make(r, world)
        encoded.append(encode_local_plan(plan))
        if r == mid:
            mine_local = plan
    t_local = (time.perf_counter() - t_local) / world
    sample_encode_s, _ = timed(lambda: encode_local_plan(mine_local))
    gathered = sum(len(b) for b in encoded)
    local_bytes = max(len(encoded[0]), len(encoded[-1]))
    t_plan, gplan = timed(lambda: plan_save(LocalPlans(encoded), "20250101T000000-0123456789ab", 2))
    # the scatter: each rank's own part, encoded from columns (what plan_stage sends)
    t_parts, parts = timed(lambda: [encode_rank_rows(r, gplan.save_id, *gplan.rank_rows(r)) for r in range(world)])
    received = len(parts[mid])
    parts = None
    mine = decode_rank_plan(encode_rank_rows(mid, gplan.save_id, *gplan.rank_rows(mid)))
    # the checksum chunk (the save's default: by the checkpoint's size, 1 MiB up to 2 TiB); each
    # rank reports its files' sizes and chunk sums
    chunk = checksum_chunk_of(gplan, (chunk_mib << 20) or None)
    cached = CachedPlan(mine_local, mine, None, gplan.save_id, chunk)
    t_replan, _ = timed(lambda: cached.next("feedfacecafe"))
    by_rank: dict[int, dict[str, tuple[int, list[int]]]] = {r: {} for r in range(world)}
    for f, (n, r) in gplan.file_ends().items():
        by_rank[r][f] = (n, [0] * -(-n // chunk))
    crcs = [(chunk, by_rank[r]) for r in range(world)]
    t_md, md = timed(
        lambda: build_metadata(gplan, crcs, SaveSource(layout, None, ()), world, {})  # the commit's
    )
    t_enc, blob = timed(lambda: encode_metadata(md))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # this process measures one size
    encoded.clear()  # the coordinator keeps only the encoded metadata from here on
    crcs.clear()
    md = None  # type: ignore[assignment]
    with gc_paused():  # as a load decodes it (engine.load.pipeline runs the whole load so)
        t_dec, md2 = timed(lambda: decode_metadata(blob))
    if freeze_gc:  # the decoded metadata (millions of records) leaves the collector's view
        gc.collect()
        gc.freeze()
    targets = load_targets(layout, load_world // 2, load_world)
    with gc_paused():  # as the load pipeline runs it (engine.load.pipeline: the whole load)
        t_load, reads = timed(lambda: plan_local_load(md2, targets))
    # every rank of the new job plans its load and reports its needs (what it sends rank 0)
    names = list(md2.tensors)

    def report_of(r: int) -> tuple[str, bytes]:
        found = plan_local_load(md2, load_targets(layout, r, load_world))
        return ("host", report_needs(md2, {(x.fqn, x.shard_index): x.rows for x in found}, names))

    t_needs, reports = timed(lambda: [report_of(r) for r in range(load_world)])
    # the coordinator: counts, disjoint rows, the read assignment, each rank's part (read_exchange)
    extents = extents_of(md2, True)
    with gc_paused():  # as the load pipeline runs it (engine.load.pipeline)
        t_assign, parts = timed(lambda: read_parts(md2, reports, True, False, extents))
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sampled = load_world // 2
    sent = len(reports[sampled][1])  # one rank's report, and the part it gets back
    batches, apart, shared = parts[sampled]
    part_bytes = sum(len(k) + len(o) + 8 * (4 + len(c)) for _, _, c, k, o, _ in batches or ())
    part_bytes += len(apart) + len(shared)  # its batches (ids, ranks, keys, offsets) and bit masks
    needs_total = sum(len(n) for _, n in reports) // 24
    keys = _keys(md2, layout, sampled, load_world)
    t_decode, _ = timed(lambda: decode_part(parts[sampled], names, keys, sampled))
    return {
        "local plan s/rank": t_local,
        "local plan encode s": sample_encode_s,
        "local plan bytes/rank": local_bytes,
        "gathered MB": gathered / 1e6,
        "global plan s": t_plan,
        "scatter encode s (all ranks)": t_parts,
        "received bytes/rank": received,
        "cached replan s/rank": t_replan,
        "metadata build s": t_md,
        "metadata encode s": t_enc,
        "metadata MB": len(blob) / 1e6,
        "checksum chunk MiB": chunk / (1 << 20),
        "metadata decode s": t_dec,
        "load plan s/rank": t_load,
        "read assignment s (whole job)": t_assign,
        "needs (whole job)": needs_total,
        "part decode s/rank": t_decode,
        "load needs sent bytes/rank": sent,
        "load part received bytes/rank": part_bytes,
        "all_gather of needs bytes/rank (before)": sent * load_world,
        "coordinator peak GiB": peak / (1 << 30),
        "coordinator peak GiB (load)": load_peak / (1 << 30),
        "shards": sum(len(t.shards) for t in md2.tensors.values()),
        "reads/rank": len(reads),
        "needs s": t_needs,
    }


PER_RANK = (
    "local plan s/rank",
    "local plan bytes/rank",
    "received bytes/rank",
    "cached replan s/rank",
    "load plan s/rank",
    "load needs sent bytes/rank",
    "load part received bytes/rank",
    "part decode s/rank",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="256,1024", help="world sizes of the FSDP layout (comma-separated)")
    ap.add_argument("--layouts", default="fsdp", help="fsdp, megatron (comma-separated)")
    ap.add_argument(
        "--freeze-gc",
        action="store_true",
        help="gc.freeze() after decoding, so that the load rows do not include full collections walking the metadata",
    )
    ap.add_argument(
        "--checksum-chunk-mib",
        type=int,
        default=0,
        help="SaveOptions.checksum_chunk_bytes in MiB (metadata holds 4 bytes per chunk of data); 0: auto",
    )
    ap.add_argument("--one", nargs=3, metavar=("LAYOUT", "WORLD", "LOAD_WORLD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # one world size in a fresh process (so its peak RSS is its own)
        layout, world, load_world = args.one[0], int(args.one[1]), int(args.one[2])
        print(json.dumps(measure(layout, world, load_world, args.freeze_gc, args.checksum_chunk_mib)))
        return
    for layout in args.layouts.split(","):
        sizes = [int(x) for x in args.ranks.split(",")] if layout == "fsdp" else [128 * 70]
        rows = []
        for world in sizes:
            load_world = 4800 if layout == "fsdp" and world > 1024 else max(2, world * 3 // 4 + 1)
            if layout == "megatron":
                load_world = 8 * 8 * 70
            t0 = time.perf_counter()
            cmd = [sys.executable, __file__, "--one", layout, str(world), str(load_world)]
            cmd += ["--freeze-gc"] if args.freeze_gc else []
            cmd += ["--checksum-chunk-mib", str(args.checksum_chunk_mib)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"[{layout} {world} ranks -> load at {load_world}: {time.perf_counter() - t0:.0f} s]", flush=True)
            rows.append((world, r))
        keys = list(rows[0][1])
        print(f"\n{layout}: " + " | ".join(f"{w} ranks" for w, _ in rows))
        for k in keys:
            vals = [r[k] for _, r in rows]
            line = f"  {k:34s}" + "".join(f"{v:>14.4g}" for v in vals)
            if len(rows) > 1 and all(v > 0 for v in vals):
                growth = [
                    math.log(b / a) / math.log(w2 / w1)
                    for (w1, a), (w2, b) in zip(((w, r[k]) for w, r in rows), ((w, r[k]) for w, r in rows[1:]))
                ]
                line += "   growth exponent " + ", ".join(f"{g:+.2f}" for g in growth)
                if k in PER_RANK:
                    line += "  (per rank)"
            print(line)


if __name__ == "__main__":
    main()
