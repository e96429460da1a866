#!/usr/bin/env bash
# The GPU check run on a lent CUDA machine (one command, results under $OUT):
#   1. the CUDA tests (pinned staging reused across saves, CUDA async snapshot, optimizer state
#      placed on the parameters' device), then the engine / planning / multi-rank suites on
#      that machine's Python and torch build;
#   2. bench/cuda_async.py: async / sync save and load of a GPU model vs DCP, /dev/shm target.
# Wheels the image lacks (crc32c) travel in .whl (see the device notes); OUT defaults to ./out.
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_async_save.py tests/test_resume_single.py 2>&1 | tail -n 25 | tee "$OUT/cuda_tests.log"
# ~250 tests: 200 s ran ~217 of them on an H100 machine (16 cores); a stop by the limit is said
timeout 260 python3 -m pytest -q -p no:cacheprovider -n 12 tests/engine tests/planning tests/distributed tests/frameworks 2>&1 | tail -n 25 | tee "$OUT/suite.log" \
  || echo "suite stopped (exit ${PIPESTATUS[0]}: 124 is the time limit)" | tee -a "$OUT/suite.log"
timeout 200 python3 bench/cuda_async.py --gib 2 --repeats 3 --dir /dev/shm 2>&1 | tee "$OUT/cuda_async.log"
