#!/usr/bin/env bash
# The GPU check, run on a lent CUDA machine as one command (results under $OUT, default ./out):
#   1. the CUDA tests (async snapshot into pinned staging, loads onto CUDA tensors, RNG state,
#      optimizer state on the parameters' device);
#   2. bench/cuda_load.py: cold load onto the GPU vs PyTorch DCP and the raw bytes;
#   3. bench/step_interference.py --device cuda: training steps during a background save;
#   4. the trainer integrations on one GPU: torchtitan's own Trainer, Lightning's FSDPStrategy,
#      Accelerate's FSDP plugin;
#   5. bench/recovery.py --device cuda: the RAM tier on CUDA state (issue 40: a RAM save's blocking
#      time and the step time during replication against an async disk save, recovery from peers
#      and intact hosts onto the GPU, a restart in fresh processes; a local durable tier).
# Wheels the machine's image lacks travel in .whl (see the device notes in docs/notes/gpu.md).
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  nproc; } 2>&1 | tee "$OUT/gpu.txt"
step() {  # step NAME SECONDS COMMAND...: one part, its log in $OUT/NAME.log, a time-out said
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tail -n 60 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name rc=$rc" | tee -a "$OUT/$name.log"
}
step cuda_tests 70 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/engine/load/test_device_cuda.py \
  tests/unit/engine/save/test_pipeline_async.py tests/unit/engine/load/test_resize_plain_tensors.py \
  tests/unit/test_resume_single.py tests/unit/format/test_values.py
step torchtitan 130 python3 -m pytest -q -p no:cacheprovider -rA tests/integration/integrations/test_torchtitan_trainer.py
step fsdp 110 python3 -m pytest -q -p no:cacheprovider -rA tests/integration/integrations/test_fsdp_gpu.py
step cuda_load 130 python3 bench/cuda_load.py --gib 2 --rounds 3 --dirs /tmp,/dev/shm
step step_interference 90 python3 bench/step_interference_cuda.py --gib 2 --rounds 4 --dir /tmp
step recovery 60 python3 bench/recovery.py --device cuda --durable-dir /tmp --hosts 2 --gib 0.25 --rounds 1 --restarts 1
