"""Writes the golden format-version-1 checkpoints under tests/format/golden/ (run once, with the
unickpt that wrote format version 1; kept to document how they were made, never run by tests).

Every tensor value is a closed formula of its key and index (``expected_value`` in
tests/format/test_golden.py computes the same numbers without unickpt), so the test's
expectations never come from the code under test.

  v1_fsdp2_ws3/  FSDP2 on 3 gloo ranks (uneven Shard(0) pieces), fp32 + bf16 parameters, an
                 int64 buffer, AdamW state (step = 7), per-rank extra_state of many value types.
  v1_table/      one process; a tensor saved as 70 row shards, so its shard table uses the
                 binary (base64 int64) form, plus a 0-d tensor and an empty tensor.
"""

import os
import sys
import zlib

import numpy as np
import torch
from torch import nn

OUT = sys.argv[1]


def formula(key: str, shape, dtype):
    n = int(np.prod(shape)) if len(shape) else 1
    seed = zlib.crc32(key.encode()) % 97
    vals = (torch.arange(n, dtype=torch.float64) * 0.25 + seed) % 13 - 6.5
    return vals.reshape(shape).to(dtype)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 4, bias=False)
        self.b.to(torch.bfloat16)
        self.register_buffer("counts", torch.zeros(5, dtype=torch.int64))

    def forward(self, x):
        return self.b(self.a(x).to(torch.bfloat16)).float()


def fill(model, optim):
    with torch.no_grad():
        for n, p in model.named_parameters():
            full = formula("model." + n, tuple(p.shape), p.dtype)
            if hasattr(p, "_local_tensor"):
                from torch.distributed.tensor import distribute_tensor

                p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
            else:
                p.copy_(full)
        model.counts.copy_(torch.arange(5) * 3 - 4)


def worker(rank, ws, out):
    from torch.distributed.fsdp import fully_shard

    import unickpt

    torch.manual_seed(0)
    model = Net()
    fully_shard(model.a)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.125, betas=(0.5, 0.75), weight_decay=0.0625)
    x = torch.ones(2, 7)
    model(x).sum().backward()
    optim.step()
    optim.zero_grad()
    fill(model, optim)
    with torch.no_grad():
        for g in optim.param_groups:
            for p in g["params"]:
                name = next(n for n, q in model.named_parameters() if q is p)
                st = optim.state[p]
                st["step"].fill_(7.0)
                for k in ("exp_avg", "exp_avg_sq"):
                    full = formula(f"optimizer.state.{name}.{k}", tuple(p.shape), st[k].dtype).abs()
                    from torch.distributed.tensor import distribute_tensor

                    st[k].copy_(distribute_tensor(full, st[k].device_mesh, st[k].placements))
    extra = {
        "step": 7,
        "rank": rank,
        "name": "golden",
        "ratio": 0.375,
        "big": 2**70,
        "nan": float("nan"),
        "tuple": (1, "two", None),
        "bytes": b"\x00\x01golden",
        "list": [1, [2, [3]]],
        "ints": {1: "one", 2: "two"},
        "tensor": torch.arange(6, dtype=torch.int32).reshape(2, 3) + rank,
        "array": np.arange(4, dtype=np.float64) / 8 + rank,
    }
    unickpt.save(out, {"model": model, "optimizer": optim, "extra_state": extra}, framework="fsdp2")
    return 0


def table(out):
    """A 70-shard tensor via the engine's own plan path: 70 local plans of one process each."""
    import crc32c

    from unickpt.engine.bytes_view import tensor_bytes
    from unickpt.engine.save import SaveRequest, build_metadata
    from unickpt.format.codec import encode_metadata
    from unickpt.format.records import METADATA_FILE
    from unickpt.planning.save import LocalSavePlan, plan_save
    from unickpt.planning.specs import ShardSpec

    full = formula("model.rows", (70, 3), torch.float32)
    scalar = formula("model.scalar", (), torch.float64)
    locals_ = []
    tensors = {}
    for r in range(70):
        specs = [ShardSpec("model.rows", "float32", (70, 3), (r, 0), (1, 3))]
        tensors[r] = [full[r : r + 1]]
        if r == 0:
            specs.append(ShardSpec("model.scalar", "float64", (), (), ()))
            specs.append(ShardSpec("model.empty", "float32", (0, 4), (0, 0), (0, 4)))
            tensors[r] += [scalar, torch.empty(0, 4)]
        locals_.append(LocalSavePlan(r, tuple(specs)))
    gplan = plan_save(locals_, "golden-table", files_per_rank=1)
    crcs = []
    for rp in gplan.rank_plans:
        parts, rank_crcs = {}, []
        for e in rp.entries:
            data = bytes(tensor_bytes(tensors[rp.rank][e.item_index]))
            buf = parts.setdefault(e.file, bytearray())
            buf += bytes(e.byte_offset - len(buf)) + data
            rank_crcs.append(crc32c.crc32c(data))
        for name, buf in parts.items():
            path = os.path.join(out, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "wb").write(bytes(buf))
        crcs.append(rank_crcs)
    md = build_metadata(gplan, crcs, SaveRequest("torch", None, ()), 70, {})
    open(os.path.join(out, METADATA_FILE), "wb").write(encode_metadata(md))


if __name__ == "__main__":
    from unickpt.testing.launch import run_ranks

    os.makedirs(OUT, exist_ok=True)
    run_ranks(worker, 3, os.path.join(OUT, "v1_fsdp2_ws3"), threads=1)
    table(os.path.join(OUT, "v1_table"))
