#!/usr/bin/env bash
# One device call: every catalog cell (all GPU widths) and the targets against the reference on the H200.
# Run through the device tool from the repo root with `.whl` (pytest and its needs) carried:
#   bash benchmarks/gpu_certify.sh                 # everything (231 real-width cells + the tiny ones + targets)
#   bash benchmarks/gpu_certify.sh -k "moe or gemm"   # extra arguments go to pytest: split a run that would pass
#   bash benchmarks/gpu_certify.sh -k "not (moe or gemm)"   # the 10-minute limit of one device call
# The K3 MoE cells hold a 59 GB expert stack (896 x 3072 x 3584, bf16) on the GPU: one H200 per run.
# Writes $OUT/gpu_tests.log (full), $OUT/junit.xml and $OUT/summary.txt (pass/fail per test file, times).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"
start=$(date +%s)
timeout "${LIMIT:-540}" python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 300 \
  tests/test_catalog_cells.py tests/test_targets.py tests/test_kda_kernels.py tests/test_mla_kernels.py \
  tests/test_moe_norm_kernels.py tests/test_quant_targets.py --junitxml "$OUT/junit.xml" -rf --durations=15 "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
echo "wall $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -1 | tee -a "$OUT/summary.txt"
