#!/usr/bin/env bash
# The fast-path session's device calls, one phase per call (each must end inside the device tool's 10 minutes):
#   bash benchmarks/gpu_run.sh check      # the new GPU tests: graphs vs eager, sampler, fused entries, random load,
#                                         #   quantized GEMMs, targets vs reference
#   bash benchmarks/gpu_run.sh bench      # the speed table: kl8 (graphs and eager), kl27
#   bash benchmarks/gpu_run.sh bench8     # kl8 alone
#   bash benchmarks/gpu_run.sh kernels    # KDA prefill (ours vs fla), sampler, quantized GEMM benchmarks
#   bash benchmarks/gpu_run.sh k3         # two real-width K3 MoE layers
#   bash benchmarks/gpu_run.sh certify    # every catalog cell (benchmarks/gpu_certify.sh)
#   bash benchmarks/gpu_run.sh diag TESTS # named tests, verbose (-v, full failures, stacks of hung tests)
#   bash benchmarks/gpu_run.sh quant27    # 27-layer Kimi Linear bf16 vs MXFP4 experts; W4A16 GEMMs
#   bash benchmarks/gpu_run.sh verify     # after changes: the GPU tests of targets, graphs, launches, quantized
#                                         #   targets and KV, speculation, disagg units; then the cells of the
#                                         #   kernels changed since the last certification
#   bash benchmarks/gpu_run.sh session4   # the GPU tests the third session's work left unrun (targets' verify, FP8
#                                         #   weight read, fla configs, launch counts, no-sync, chunked sampler)
#   bash benchmarks/gpu_run.sh newcells   # the cells of the entries added or changed then
#   bash benchmarks/gpu_run.sh session7   # no JIT after start-up (tests + benchmarks/jit_probe.py), kl8 async, top-k
#   bash benchmarks/gpu_run.sh session6   # kl8 async on/off, top-k sampler, async CUDA checks (~8 min)
#   bash benchmarks/gpu_run.sh session5   # the fourth session's GPU checks (launch counts, top-k sampler, quantized KV
#                                         #   tiles, paged DSpark block, KDA decode warps, MoE permute blocks, W4A16 decode)
#   bash benchmarks/gpu_run.sh flacfg     # dump fla-core's tuned configs for this GPU (commit them)
#   bash benchmarks/gpu_run.sh disagg     # 1P1D vs aggregated serving of kl8, two servers sharing the GPU
#                                         #   (benchmarks/disagg_bench.py --preset h200; needs serve_wheels.sh's wheels)
#   bash benchmarks/gpu_run.sh spectest   # speculative verify steps under CUDA graphs (tests) + spec on targets
#   bash benchmarks/gpu_run.sh specbench  # benchmarks/spec_bench.py --quick: K3 layers + real-width drafter
#   bash benchmarks/gpu_run.sh session11a # spec_bench at K 7, batch 1 / 8 / 32, with --profile
#   bash benchmarks/gpu_run.sh session11b # the fused Markov step's cells and tests, DSpark CUDA tests, spec_bench
#                                         #   (SPEC_FULL=1: every batch size 1..64, more steps)
#   WHEELS=.whlx bash benchmarks/gpu_run.sh nixl   # NIXL and ZMQ transport rows (carry `.whlx`: nixl, nixl_cu13 (56 MiB),
#                                         #   pyzmq, xxhash, fla-core, einops; with the repo it just fits the 64 MiB)
#   bash benchmarks/gpu_run.sh profile    # kernel time per decode step by kernel (kl8, batch 1 and 64, one 8K prefill)
#   bash benchmarks/gpu_run.sh kdadec     # the streamed KdaDecode: its tests (graph replay included), its cells, and
#                                         #   benchmarks/kda_decode_bench.py --sweep (us and GB/s at batch 1-64)
#   bash benchmarks/gpu_run.sh w4tc       # the tensor-core W4A16 decode kernel: its CUDA tests (inline PTX against the
#                                         #   reference, every code exact), quant_gemm_bench --quick (tc and gemv side
#                                         #   by side), one --sweep case (SWEEP_CASE), the SASS table (~8 min)
# Carry `.whl` (fla-core, einops; for disagg also benchmarks/serve_wheels.sh's). Logs and JSON land in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-.whl}/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
phase=${1:?phase: check | bench | kernels | k3 | certify}; shift
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
pytest_gpu() {   # name, limit_s, pytest args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 240 -rf "$@" \
    --junitxml "$OUT/$name.xml" 2>&1 | tee "$OUT/$name.log" | tail -25
}
case "$phase" in
  check)
    pytest_gpu check 540 tests/test_graphs_cuda.py tests/test_runtime_sampler.py tests/test_fused_kda_decode.py \
      tests/test_fused_add_mix_norm.py tests/test_fused_moe.py tests/test_random_load.py tests/test_quant_gemm.py \
      tests/test_quant_gemm_fp8.py tests/test_targets.py "$@" ;;
  bench)
    timeout 330 python3 benchmarks/h200_fastpath.py --model kl8 --out "$OUT/fastpath_kl8.json" 2>&1 | tee "$OUT/kl8.log" | grep -v "^{" | tail -30
    timeout 200 python3 benchmarks/h200_fastpath.py --model kl27 --out "$OUT/fastpath_kl27.json" 2>&1 | tee "$OUT/kl27.log" | grep -v "^{" | tail -12 ;;
  async)       # async scheduling: the CUDA checks, then kl8's decode rows with it on (graphs) and off (graphs-sync)
    pytest_gpu async 300 tests/test_graphs_cuda.py -k "async" "$@"
    timeout 420 python3 benchmarks/h200_fastpath.py --model kl8 --iters 3 --compare-async --out "$OUT/fastpath_kl8_async.json" \
      2>&1 | tee "$OUT/kl8_async.log" | grep -v "^{" | tail -20 ;;
  session6)    # the fifth session's last call: kl8 with async scheduling on / off, the top-k sampler, the async checks
    timeout 280 python3 benchmarks/h200_fastpath.py --model kl8 --iters 3 --compare-async --out "$OUT/fastpath_kl8_async.json" \
      2>&1 | tee "$OUT/kl8_async.log" | grep -v "^{" | tail -20
    timeout 60 python3 benchmarks/sampler_bench.py --kinds top_k top_p top_k_top_p --batch 64 --json "$OUT/sampler_topk.json" \
      2>&1 | tail -5
    pytest_gpu async 130 tests/test_graphs_cuda.py -k async "$@" ;;
  session7)    # the fifth session's unrun GPU work: no JIT after start-up (tests + probe), sampler warm-up, kl8 async
    pytest_gpu nojit 130 tests/test_runtime_sampler.py tests/test_graphs_cuda.py \
      -k "compiles_nothing_after_warm_up or sampler_kernel or no_triton_compile or async" "$@"
    timeout 120 python3 benchmarks/jit_probe.py --out "$OUT/jit_probe.json" 2>&1 | tee "$OUT/jit_probe.log" | grep -v "^{" | tail -12
    timeout 260 python3 benchmarks/h200_fastpath.py --model kl8 --iters 3 --compare-async --out "$OUT/fastpath_kl8_async.json" \
      2>&1 | tee "$OUT/kl8_async.log" | grep -E -v "^\{|captured decode graph" | tail -24
    timeout 50 python3 benchmarks/sampler_bench.py --kinds top_k top_p top_k_top_p --batch 64 --json "$OUT/sampler_topk.json" \
      2>&1 | tail -5 ;;
  session7b)   # the warm-up's fix (a slot per segment) checked, then where the time goes: kl8 profile, kl27 bf16
    pytest_gpu nojit 120 tests/test_graphs_cuda.py -k "no_triton_compile" "$@"
    timeout 100 python3 benchmarks/jit_probe.py --out "$OUT/jit_probe.json" 2>&1 | tee "$OUT/jit_probe.log" | grep -v "^{" | tail -8
    timeout 200 python3 benchmarks/decode_profile.py --model kl8 --batch 1 --batch 64 --prefill 8192 \
      --out "$OUT/profile_kl8.json" 2>&1 | tee "$OUT/profile.log" | grep -E -v "^\{|captured decode graph" | tail -90
    timeout 150 python3 benchmarks/h200_fastpath.py --model kl27 --iters 2 --out "$OUT/fastpath_kl27.json" 2>&1 \
      | tee "$OUT/kl27.log" | grep -E -v "^\{|captured decode graph" | tail -8 ;;
  session7c)   # the prefill changes: MoE GEMM tile sweep, syncs and rate of an 8K prefill, the burst no-JIT tests
    timeout 150 python3 benchmarks/moe_gemm_sweep.py --json "$OUT/moe_gemm_sweep.json" 2>&1 | tee "$OUT/moe_gemm_sweep.log" | tail -34
    timeout 130 python3 benchmarks/jit_probe.py --out "$OUT/jit_probe.json" 2>&1 | tee "$OUT/jit_probe.log" | grep -v "^{" | tail -16
    pytest_gpu nojit 120 tests/test_graphs_cuda.py -k "no_triton_compile" "$@" ;;
  session7d)   # KdaDecode's streamed state and the parallel MoE permute: tests, cells, kernel benches, then kl8
    pytest_gpu gpu 200 tests/test_fused_kda_decode.py tests/test_moe_permute_small.py tests/test_graphs_cuda.py \
      -k "not compiles_for_the_h200 and not memory_plan and not sampler_kernel" "$@"
    LIMIT=120 bash benchmarks/gpu_certify.sh -p benchmarks._instafail -k "KdaDecode or MoePermuteSmall" | tail -4
    timeout 90 python3 benchmarks/kda_decode_bench.py --sweep --json "$OUT/kda_decode.json" 2>&1 | tail -30
    timeout 60 python3 benchmarks/permute_bench.py --json "$OUT/permute.json" 2>&1 | tail -16
    timeout 200 python3 benchmarks/h200_fastpath.py --model kl8 --iters 2 --out "$OUT/fastpath_kl8.json" 2>&1 \
      | tee "$OUT/kl8.log" | grep -E -v "^\{|captured decode graph" | tail -14
    tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls | grep -v -E "\.json$|kl8.log") 2>/dev/null ;;
  session7e)   # the session's last call: the short conv's planes (cells, bench), then kl8 (it also ran the reverted MoE GEMVs)
    LIMIT=60 bash benchmarks/gpu_certify.sh -p benchmarks._instafail -k "ShortConv or Gemv" | tail -4
    timeout 40 python3 benchmarks/short_conv_bench.py --json "$OUT/short_conv.json" 2>&1 | tail -12
    timeout 150 python3 benchmarks/h200_fastpath.py --model kl8 --iters 2 --skip-eager --out "$OUT/fastpath_kl8.json" 2>&1 \
      | tee "$OUT/kl8.log" | grep -E -v "^\{|captured decode graph" | tail -10
    tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls | grep -v -E "\.json$|kl8.log") 2>/dev/null ;;
  session8a)   # the seventh session's first call: W4A16 GEMMs (decode GEMV never timed), torch._grouped_mm as the
               # prefill MoE GEMM candidate, then kl27 bf16 against MXFP4 experts at batch 1
    timeout 100 python3 benchmarks/quant_gemm_bench.py --quick --out "$OUT/quant_gemm.json" 2>&1 \
      | tee "$OUT/quant_gemm.log" | grep -v "^{" | tail -40
    timeout 70 python3 benchmarks/moe_gemm_sweep.py --configs current --json "$OUT/moe_gemm_sweep.json" 2>&1 | tail -12
    for q in "" mxfp4; do
      timeout 160 python3 benchmarks/h200_fastpath.py --model kl27 --iters 2 --skip-eager ${q:+--quant $q} \
        --out "$OUT/fastpath_kl27${q:+_$q}.json" 2>&1 | tee "$OUT/kl27${q:+_$q}.log" | grep -E -v "^\{|captured decode graph" | tail -6
    done
    tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls | grep -v -E "\.json$") 2>/dev/null ;;
  session8b)   # where a kl8 step's time goes now (batch 1 / 64, one 8K prefill), then K3 with four real-width layers
               # and MXFP4 experts at batch 1 / 8 / 64 (issue 10's record: per-layer step time against its floor)
    timeout 220 python3 benchmarks/decode_profile.py --model kl8 --batch 1 --batch 64 --prefill 8192 \
      --out "$OUT/profile_kl8.json" 2>&1 | tee "$OUT/profile.log" | grep -E -v "^\{|captured decode graph" | tail -60
    timeout 260 python3 benchmarks/h200_fastpath.py --model k3-4l --quant mxfp4 --iters 2 --skip-eager \
      --out "$OUT/fastpath_k3_4l_mxfp4.json" 2>&1 | tee "$OUT/k3.log" | grep -E -v "^\{|captured decode graph" | tail -8
    tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls | grep -v -E "\.json$") 2>/dev/null ;;
  session8c)   # the router GEMV on the GPU (cells, tests), the small decode launches in graphs (GEMM forms, router,
               # MLA decode splits x tiles), then kl8 with the router GEMV
    LIMIT=60 bash benchmarks/gpu_certify.sh -p benchmarks._instafail -k "MoeRouterBf16" | tail -3
    timeout 120 python3 benchmarks/decode_small_probe.py --json "$OUT/decode_small_probe.json" 2>&1 | tail -80
    timeout 170 python3 benchmarks/h200_fastpath.py --model kl8 --iters 2 --skip-eager --out "$OUT/fastpath_kl8.json" 2>&1 \
      | tee "$OUT/kl8.log" | grep -E -v "^\{|captured decode graph" | tail -10
    tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls | grep -v -E "\.json$|kl8.log") 2>/dev/null ;;
  session8d)   # the batch-1 GEMV against cuBLAS over its configs, the router GEMV's batch-1 config, and whether Triton
               # compiles in parallel threads here (start-up)
    timeout 150 python3 benchmarks/decode_small_probe.py --json "$OUT/decode_small_probe.json" 2>&1 | grep -v "^mla" | tail -70
    timeout 120 python3 benchmarks/compile_probe.py --variants 24 --threads 16 2>&1 | tail -3 ;;
  session8e)   # the seventh session's last call: kl8 at batch 1 with the router / Linear GEMVs, their cells and the
               # 32-split MLA cells, the tensor-core W4A16 decode kernel (CUDA tests, decode bench), DSpark with
               # propose graphs (spec_bench, K = 7)
    timeout 150 python3 benchmarks/h200_fastpath.py --model kl8 --iters 2 --skip-eager --batches 1 \
      --out "$OUT/fastpath_kl8_b1.json" 2>&1 | tee "$OUT/kl8.log" | grep -E -v "^\{|captured decode graph" | tail -6
    LIMIT=45 bash benchmarks/gpu_certify.sh -p benchmarks._instafail \
      -k "test_cell and (Linear and not Fp8 and not W4A16 or RouterBf16 or MlaDecode)" | tail -3
    TEST_TIMEOUT=80 LIMIT=85 bash "$0" diag tests/test_w4a16_decode.py -k tc | tail -12
    timeout 115 python3 benchmarks/quant_gemm_bench.py --quick --only decode --out "$OUT/quant_gemm_tc.json" 2>&1 \
      | tee "$OUT/quant_gemm.log" | grep -v "^{" | tail -75
    timeout 175 python3 benchmarks/spec_bench.py --quick --k 7 --steps 8 --warmup 2 --out "$OUT/spec_k3.json" 2>&1 \
      | tee "$OUT/spec.log" | grep -v "^{" | tail -10
    tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls | grep -v -E "\.json$") 2>/dev/null ;;
  session9a)   # the eighth session's first call: kl27 at batch 1 on a cold machine first (with the GEMVs; its start-up is
               # the cold-start baseline), the seventh session's unrun cells (32-split MLA decode, router and Linear
               # GEMVs) and CUDA tests (propose graphs), the tensor-core W4A16 decode tiles at K3 MXFP4 batch 1 / 8 / 64
               # (fewer registers, more warps a SM: BK 128, 1-2 warps)
    timeout 210 python3 benchmarks/h200_fastpath.py --model kl27 --iters 2 --skip-eager --batches 1 \
      --out "$OUT/fastpath_kl27_b1.json" 2>&1 | tee "$OUT/kl27.log" | grep -E -v "^\{|captured decode graph" | tail -6
    LIMIT=110 bash benchmarks/gpu_certify.sh -p benchmarks._instafail \
      -k "test_cell and (MlaDecode or RouterBf16 or (Linear and not Fp8 and not W4A16))" | tail -3
    cp "$OUT/gpu_tests.log" "$OUT/cells.log"
    TEST_TIMEOUT=80 LIMIT=90 bash "$0" diag tests/test_verify_graphs_cuda.py -k "dspark or propose" | tail -12
    timeout 130 python3 benchmarks/quant_gemm_bench.py --quick --only "K3 mxfp4 decode" --tc-grid "16,128,256,2,3 \
      16,128,128,2,3 16,128,128,2,4 16,128,128,1,3 16,128,128,4,3 16,64,256,2,3 16,64,128,1,3 16,64,128,2,3 \
      16,64,128,1,4 16,32,128,1,3" --out "$OUT/quant_gemm_tcgrid.json" 2>&1 | grep -v "^{" | tail -120
    tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls | grep -v -E "\.json$") 2>/dev/null ;;
  session10a)  # the ninth session's first call: kl27 at batch 1 cold with start-up's compiles in worker processes
               # (runtime/precompile.py; the cold-start baseline was 111 s), the top-k sampler's folded kth launches
               # (CUDA tests, then their time at batch 64), graphs vs eager and no JIT after a dry-run start-up
    timeout 220 python3 benchmarks/h200_fastpath.py --model kl27 --iters 2 --skip-eager --batches 1 \
      --out "$OUT/fastpath_kl27_b1.json" 2>&1 | tee "$OUT/kl27.log" | grep -E -v "^\{|captured decode graph" | tail -6
    grep -E "compiled ahead|compiling ahead|warmed up|CUDA graphs:|weights:|ready|planning" "$OUT/kl27.log" | cut -c1-220 | head -12
    TEST_TIMEOUT=120 LIMIT=130 bash "$0" diag tests/test_runtime_sampler.py -k cuda | tail -12
    cp "$OUT/diag.log" "$OUT/diag_sampler.log"
    timeout 60 python3 benchmarks/sampler_bench.py --kinds top_k top_p top_k_top_p --batch 64 --json "$OUT/sampler_topk.json" \
      2>&1 | tail -5
    TEST_TIMEOUT=150 LIMIT=170 bash "$0" diag tests/test_graphs_cuda.py -k "bitwise or no_triton_compile or memory_plan" | tail -12
    tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls | grep -v -E "\.json$|kl27.log") 2>/dev/null ;;
  session10b)  # where the cold start goes with and without the compile workers (kl8, cProfile), the precompile tests
    timeout 200 python3 benchmarks/startup_profile.py --model kl8 --top 45 2>&1 | tee "$OUT/startup_profile.log" \
      | grep -v "captured decode graph" | cut -c1-200 | head -150
    timeout 200 python3 benchmarks/startup_profile.py --model kl8 --top 25 --no-precompile 2>&1 \
      | tee "$OUT/startup_profile_off.log" | grep -v "captured decode graph" | cut -c1-200 | head -40
    tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls | grep -v -E "\.json$") 2>/dev/null ;;
  session10c)  # kl27 at batch 1 cold with the warm-up's steps capped at what serving can hold and the dry runs only where
               # compiling ahead is on; the no-JIT and memory-plan CUDA tests; the propose-graph tests cut last time
    timeout 200 python3 benchmarks/h200_fastpath.py --model kl27 --iters 2 --skip-eager --batches 1 \
      --out "$OUT/fastpath_kl27_b1.json" 2>&1 | tee "$OUT/kl27.log" | grep -E -v "^\{|captured decode graph" | tail -4
    grep -E "compiled ahead|compiling ahead|CUDA graphs:|weights:|planning" "$OUT/kl27.log" | cut -c1-330 | head -8
    TEST_TIMEOUT=120 LIMIT=140 bash "$0" diag tests/test_graphs_cuda.py \
      -k "no_triton_compile or memory_plan or compiles_no_sampler" | tail -8
    cp "$OUT/diag.log" "$OUT/diag_graphs.log"
    TEST_TIMEOUT=120 LIMIT=190 bash "$0" diag tests/test_verify_graphs_cuda.py -k "dspark or propose" | tail -14
    tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls | grep -v -E "\.json$|kl27.log") 2>/dev/null ;;
  session10d)  # kl8 at batch 1 and 64, greedy and top-p, 8K prefill, cold, with start-up compiling ahead (no JIT after it:
               # each row's first run against its steady ones)
    timeout 420 python3 benchmarks/h200_fastpath.py --model kl8 --iters 3 --skip-eager --out "$OUT/fastpath_kl8.json" 2>&1 \
      | tee "$OUT/kl8.log" | grep -E -v "^\{|captured decode graph" | tail -10
    grep -E "compiled ahead|CUDA graphs:|weights:" "$OUT/kl8.log" | cut -c1-330 | head -6 ;;
  session10e)  # the top-k sampler's device time by kernel (graph replays under torch.profiler), then K3 with four
               # real-width layers and MXFP4 experts at batch 1 / 8 / 64 with the BK 128 tensor-core decode tiles
    timeout 60 python3 benchmarks/sampler_bench.py --kinds top_k top_p --batch 64 --profile \
      --json "$OUT/sampler_profile.json" 2>&1 | tail -30
    timeout 270 python3 benchmarks/h200_fastpath.py --model k3-4l --quant mxfp4 --iters 2 --skip-eager \
      --out "$OUT/fastpath_k3_4l_mxfp4.json" 2>&1 | tee "$OUT/k3.log" | grep -E -v "^\{|captured decode graph" | tail -8 ;;
  session10f)  # the top-k sampler's windowed first digit (the whole histogram only for rows it cannot place): CUDA tests,
               # its time by kernel at batch 64, and no sampler compile after start-up
    TEST_TIMEOUT=100 LIMIT=110 bash "$0" diag tests/test_runtime_sampler.py -k cuda | tail -12
    timeout 60 python3 benchmarks/sampler_bench.py --kinds top_k top_p top_k_top_p --batch 64 --profile \
      --json "$OUT/sampler_topk.json" 2>&1 | tail -30
    TEST_TIMEOUT=60 LIMIT=70 bash "$0" diag tests/test_graphs_cuda.py -k "compiles_no_sampler" | tail -3 ;;
  session11a)  # after `spectest` (the tenth session's DSpark drafts on the device, acceptance without a host sync):
               # K3 + drafter at K 7 with the propose graph's and the speculative step's device time by kernel
    timeout 540 python3 benchmarks/spec_bench.py --quick --k 7 --steps 8 --warmup 2 --profile \
      --out "$OUT/spec_k3.json" 2>&1 | tee "$OUT/spec_k3.log" | grep -v "^{" | tail -70 ;;
  session11b)  # the fused Markov step (catalog spec.draft_step): its cells and tests, the DSpark CUDA tests (propose
               # graphs capture it), then spec_bench at K 7 with --profile
    TEST_TIMEOUT=100 LIMIT=120 bash "$0" diag tests/test_draft_step.py tests/test_catalog_cells.py -k "draft_step or DraftStep" | tail -12
    cp "$OUT/diag.log" "$OUT/diag_draft_step.log"
    TEST_TIMEOUT=150 LIMIT=200 bash "$0" diag tests/test_verify_graphs_cuda.py -k "dspark or propose" | tail -12
    timeout 250 python3 benchmarks/spec_bench.py --quick --k 7 --steps 8 --warmup 2 --profile \
      --out "$OUT/spec_k3.json" 2>&1 | tee "$OUT/spec_k3.log" | grep -v "^{" | tail -40 ;;
  session12a)  # where the W4A16 decode GEMMs lose bandwidth: the bytes-only ceilings of their load patterns beside the
               # kernels (benchmarks/w4a16_probe.py), then ncu's view of the tensor-core kernel at K3 batch 64 and of
               # both decode kernels at batch 8
    timeout 260 python3 benchmarks/w4a16_probe.py --out "$OUT/w4a16_probe.json" 2>&1 | tee "$OUT/w4a16_probe.log" | tail -60
    [ -n "${GRID:-}" ] && timeout 200 python3 benchmarks/quant_gemm_bench.py --quick --only "K3 mxfp4 decode T=64 w13" --tc-grid "16,128,128,2,3
      16,128,64,2,4 16,128,64,2,6 16,256,64,4,4 16,64,64,1,4 16,128,128,2,2 16,64,128,1,2 16,256,128,4,3 16,128,64,4,4" \
      --out "$OUT/quant_gemm_tcgrid64.json" 2>&1 | tee "$OUT/quant_gemm_tcgrid64.log" | grep -v "^{" | tail -40
    for c in "T=64 tc" "T=8 gemv" "T=8 tc"; do
      set -- $c
      timeout 150 ncu --clock-control none -k regex:_w4a16 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 benchmarks/w4a16_probe.py --once "$1" --path "$2" > "$OUT/ncu_${1#T=}_$2.txt" 2>&1
      echo "== ncu $1 $2"; grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles|Issued Ipc|No Eligible|Eligible Warps|Active Warps|stalled_.*ratio +[a-z]* +[0-9.]*[1-9]" "$OUT/ncu_${1#T=}_$2.txt" | grep -v -E " 0(\.0+)?$" | head -60
    done ;;
  session12b)  # the W4A16 decode kernels' sm_90 SASS as launched (Triton's cache of the probe's launches comes back in
               # $OUT/tcache: nvdisasm it here) and their times at K3's batch 1 / 8 / 64
    TRITON_CACHE_DIR="$OUT/tcache" timeout 200 python3 benchmarks/w4a16_probe.py --kernels-only \
      --out "$OUT/w4a16_kernels.json" 2>&1 | tee "$OUT/w4a16_kernels.log" | tail -20
    find "$OUT/tcache" -type f ! -name "*.cubin" ! -name "*.json" -delete ;;
  session12c)  # the W4A16 decode split (FMA kernel over one-row experts, tensor cores over the rest): the decode tests and
               # the W4A16 cells on CUDA, the GEMMs of both models at batch 1 / 8 / 64, K3 with four real-width
               # layers (MXFP4), then the FMA kernel's config grid at K3's batch 8
    pytest_gpu w4split 200 tests/test_w4a16_decode.py tests/test_catalog_cells.py -k "w4a16 or W4A16"
    timeout 150 python3 benchmarks/quant_gemm_bench.py --quick --only "mxfp4 decode" --out "$OUT/quant_gemm_split.json" \
      2>&1 | tee "$OUT/quant_gemm_split.log" | grep -v "^{" | tail -40
    timeout 270 python3 benchmarks/h200_fastpath.py --model k3-4l --quant mxfp4 --iters 2 --skip-eager \
      --out "$OUT/fastpath_k3_4l_mxfp4.json" 2>&1 | tee "$OUT/k3.log" | grep -E -v "^\{|captured decode graph" | tail -8
    timeout 120 python3 benchmarks/quant_gemm_bench.py --quick --only "K3 mxfp4 decode T=8 w13" --tc-grid "16,128,128,2,3" \
      --out "$OUT/quant_gemm_gemvgrid.json" 2>&1 | tee "$OUT/quant_gemm_gemvgrid.log" | grep -v "^{" | tail -60 ;;
  session12d)  # where a K3 (four real-width layers, MXFP4 experts) decode step's time goes at batch 64 and 8, by kernel
    timeout 280 python3 benchmarks/decode_profile.py --model k3-4l --quant mxfp4 --batch 64 --batch 8 --steps 12 \
      --out "$OUT/profile_k3_4l_mxfp4.json" 2>&1 | grep -E -v "captured decode graph|^20[0-9-]+ " | tail -60 ;;
  session12e)  # K3 (four real-width layers, MXFP4) at batch 64: the W4A16 decode split against the tensor-core kernel alone
    for p in tc auto; do
      timeout 140 python3 benchmarks/h200_fastpath.py --model k3-4l --quant mxfp4 --iters 2 --skip-eager --batches 64 \
        --w4a16-path $p --out "$OUT/fastpath_k3_4l_b64_$p.json" 2>&1 | grep -E "^k3-4l|engine ready" | tail -4
    done ;;
  session12f)  # the session's last W4A16 changes on CUDA (fp32 activations' dot, the split, the FMA kernel's shared shift)
               # and the FMA kernel at 64 and 128 weight rows a program, K3 batch 1 / 8 / 64
    pytest_gpu w4last 80 tests/test_w4a16_decode.py -k "fp32 or split or every or swapped"
    timeout 90 python3 benchmarks/w4a16_probe.py --kernels-only --gemv-configs "1,64,256,4,3 1,128,256,4,3 2,128,256,4,3" \
      --out "$OUT/w4a16_kernels.json" 2>&1 | tail -20 ;;
  session13a)  # where an 8K prefill's device waits (kl8, host code per idle span) and kernel time per step at batch 1:
               # kl8 bf16, kl27 MXFP4, kl27 bf16
    timeout 200 python3 benchmarks/decode_profile.py --model kl8 --batch 1 --prefill 8192 --gaps --top 30 \
      --out "$OUT/profile_kl8_gaps.json" 2>&1 | grep -E -v "^\{|captured decode graph|INFO" | tail -110
    for q in mxfp4 bf16; do
      timeout 170 python3 benchmarks/decode_profile.py --model kl27 --batch 1 --top 30 $([ $q = bf16 ] || echo --quant $q) \
        --out "$OUT/profile_kl27_$q.json" 2>&1 | grep -E -v "^\{|captured decode graph|INFO" | tail -34
    done ;;
  session13b)  # the grouped GEMM's half-height tail tiles (CUDA tests, prefill sweep on / off), then where an 8K
               # prefill's device waits, host spans read from the Chrome trace (kl8)
    pytest_gpu moe 150 tests/test_moe_norm_kernels.py tests/test_fused_moe.py
    timeout 120 python3 benchmarks/moe_gemm_sweep.py --configs current --json "$OUT/moe_gemm_tail.json" 2>&1 | tail -16
    timeout 200 python3 benchmarks/decode_profile.py --model kl8 --prefill-only --prefill 8192 --gaps --top 40 \
      --out "$OUT/profile_kl8_gaps.json" 2>&1 | grep -E -v "^\{|captured decode graph|INFO" | tail -110 ;;
  session13c)  # the W4A16 decode GEMMs at Kimi Linear's batch 1 inside graphs (config grid), where an 8K prefill
               # waits (engine thread only, kernels around each span), kl8 at batch 1 with the 8K prefill row
    pytest_gpu side 200 tests/test_graphs_cuda.py tests/test_quant_targets.py -k "mxfp4"
    timeout 200 python3 benchmarks/w4a16_small_probe.py --out "$OUT/w4a16_small.json" 2>&1 | tail -60
    timeout 150 python3 benchmarks/decode_profile.py --model kl8 --prefill-only --prefill 8192 --gaps --top 25 \
      --out "$OUT/profile_kl8_gaps.json" 2>&1 | grep -E -v "^\{|captured decode graph|INFO" | sed -n '/one run/,$p' | tail -50
    timeout 200 python3 benchmarks/h200_fastpath.py --model kl8 --iters 2 --skip-eager --batches 1 \
      --out "$OUT/fastpath_kl8_b1.json" 2>&1 | grep -E "^kimi|engine ready|tok/s" | tail -8 ;;
  # session13d ran at commit 1f61051 (the FP4 Kimi Linear shared expert on a side stream, reverted after): kl27 MXFP4
  # batch 1 with it and without (its --no-shared-overlap flag went with the change); `git show 1f61051:benchmarks/gpu_run.sh`
  session13e)  # after the GLU tile rule and the pinned slot reset: the W4A16 decode tests and the MXFP4 graph tests
    pytest_gpu last 200 tests/test_w4a16_decode.py tests/test_graphs_cuda.py \
      -k "(w4a16_decode and (split or every or fp32)) or (mxfp4 and (graphs_equal_eager_bitwise or test_decode_step_makes_no_host_sync))" ;;
  session14a)  # the thirteenth session's unrun tests (GLU tile rule, pinned slot reset), MLA prefill with a shared k_rope
               # and heavy-first blocks (tests, cells), its tile sweep against SDPA's backends at an 8K prompt
    pytest_gpu last 200 tests/test_w4a16_decode.py tests/test_graphs_cuda.py \
      -k "(w4a16_decode and (split or every or fp32)) or (mxfp4 and (graphs_equal_eager_bitwise or test_decode_step_makes_no_host_sync))"
    pytest_gpu mla 150 tests/test_mla_kernels.py tests/test_catalog_cells.py -k "mla_prefill or MlaPrefill or prefill_chunk"
    timeout 150 python3 benchmarks/mla_prefill_sweep.py --json "$OUT/mla_prefill_sweep.json" 2>&1 | tail -20 ;;
  session14b)  # after the prefill host-path changes (prompt buffer, fill positions, StepPlan in bulk) and the MLA k_rope:
               # graphs / no-sync / async / prefix CUDA tests, targets vs reference, kl8 at batch 1 with the 8K prefill row
    pytest_gpu graphs 230 tests/test_graphs_cuda.py tests/test_targets.py \
      -k "(graphs_equal_eager_bitwise or no_host_sync or async or prefix or padded) and not mxfp4 or target_matches"
    timeout 200 python3 benchmarks/h200_fastpath.py --model kl8 --iters 2 --skip-eager --batches 1 \
      --out "$OUT/fastpath_kl8_b1.json" 2>&1 | grep -E "^kimi|engine ready|tok/s" | tail -8 ;;
  bench8)
    timeout 330 python3 benchmarks/h200_fastpath.py --model kl8 --iters 3 --out "$OUT/fastpath_kl8.json" 2>&1 | tee "$OUT/kl8.log" | grep -v "^{" | tail -14 ;;
  kernels)
    timeout 150 python3 benchmarks/kda_prefill_bench.py --out "$OUT/kda_prefill.json" 2>&1 | tee "$OUT/kda_prefill.log" | tail -15
    timeout 100 python3 benchmarks/sampler_bench.py --json "$OUT/sampler.json" 2>&1 | tee "$OUT/sampler.log" | tail -20
    timeout 300 python3 benchmarks/quant_gemm_bench.py --quick --out "$OUT/quant_gemm.json" 2>&1 | tee "$OUT/quant_gemm.log" | tail -40 ;;
  k3)
    timeout 540 python3 benchmarks/h200_fastpath.py --model k3-2l --out "$OUT/fastpath_k3.json" 2>&1 | tee "$OUT/k3.log" | grep -v "^{" | tail -20 ;;
  verify)
    pytest_gpu verify 330 tests/test_graphs_cuda.py tests/test_target_launches.py tests/test_targets.py \
      tests/test_quant_targets.py tests/test_kv_cache_quant.py tests/test_helix_merge.py \
      tests/test_spec_engine.py::test_cuda_speculation_equals_plain "tests/test_disagg_units.py::test_handoff_between_bf16_pools[cuda]" "$@"
    LIMIT=230 bash benchmarks/gpu_certify.sh -k "attention or grouped_gemm or add_mix or attn_res or quant" ;;
  diag)        # named GPU tests, verbose, each test's failure in full (a killed run still leaves diag.log)
    timeout "${LIMIT:-200}" python3 -m pytest -v -p no:cacheprovider -p benchmarks._instafail -o addopts="" -o faulthandler_timeout=80 \
      --timeout ${TEST_TIMEOUT:-90} --tb=short "$@" 2>&1 | tee "$OUT/diag.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|instafail|^E " ;;
  quant27)     # the 27-layer Kimi Linear 48B, bf16 and MXFP4 experts, same run; the W4A16 GEMMs vs copy bandwidth
    for q in "" mxfp4; do
      timeout 165 python3 benchmarks/h200_fastpath.py --model kl27 --iters 2 ${q:+--quant $q} \
        --out "$OUT/fastpath_kl27${q:+_$q}.json" 2>&1 | tee "$OUT/kl27${q:+_$q}.log" | grep -v "^{" | tail -6
    done
    timeout 90 python3 benchmarks/quant_gemm_bench.py --quick --out "$OUT/quant_gemm.json" 2>&1 \
      | tee "$OUT/quant_gemm.log" | tail -30 ;;
  w4tc)        # benchmarks/w4a16_sass.py needs no GPU: it runs here for Triton 3.6's SASS of the kernels benchmarked
    TEST_TIMEOUT=140 LIMIT=150 bash "$0" diag tests/test_w4a16_decode.py tests/test_quant_gemm.py
    cp "$OUT/diag.log" "$OUT/diag_w4a16.log"
    timeout 150 python3 benchmarks/quant_gemm_bench.py --quick --out "$OUT/quant_gemm.json" 2>&1 \
      | tee "$OUT/quant_gemm.log" | grep -v "^{" | tail -100
    timeout 130 python3 benchmarks/quant_gemm_bench.py --sweep --only "${SWEEP_CASE:-K3 mxfp4 decode T=8 w13+glu}" \
      --out "$OUT/quant_gemm_sweep.json" 2>&1 | grep -v "^{" | grep -v "output differs" | tail -8
    timeout 70 python3 benchmarks/w4a16_sass.py --only "T=8" 2>&1 | tail -30 ;;
  certify)
    LIMIT=${LIMIT:-540} bash benchmarks/gpu_certify.sh "$@" ;;
  session4)    # the GPU checks the third session's work left (each failure printed as it happens, see diag)
    TEST_TIMEOUT=240 LIMIT=560 bash "$0" diag tests/test_target_launches.py tests/test_graphs_cuda.py \
      tests/test_spec_targets.py tests/test_quant_targets.py tests/test_kv_quant_targets.py tests/test_fp8_weight_read.py \
      tests/test_fla_configs.py \
      "tests/test_disagg_units.py::test_handoff_between_bf16_pools[cuda]" tests/test_disagg_units.py::test_transport_multi_frame_pull \
      tests/test_runtime_sampler.py::test_cuda_kernels_draw_from_the_filtered_distribution "$@" ;;
  session5)    # what the fourth session changed and could not run on the GPU (its device time ran out); ~8 minutes
    TEST_TIMEOUT=200 LIMIT=300 bash "$0" diag tests/test_target_launches.py -k "gpu_decode" ;
    cp "$OUT/diag.log" "$OUT/diag_launch.log"
    TEST_TIMEOUT=200 LIMIT=300 bash "$0" diag tests/test_runtime_sampler.py tests/test_mla_kernels.py \
      tests/test_verify_graphs_cuda.py tests/test_graphs_cuda.py tests/test_quant_gemm.py -k "cuda or nucleus or tiles_on_an_h200 or reciprocal_multiply or dspark or bitwise or w4a16" ;
    LIMIT=240 bash benchmarks/gpu_certify.sh -p benchmarks._instafail -k "MlaCacheWriteNvfp4 or MlaDecode or MlaPrefillFp8 or KdaDecode or MoePermuteSmall or W4A16" ;;
  newcells)    # the cells of the entries added or changed in the third session
    LIMIT=${LIMIT:-540} bash benchmarks/gpu_certify.sh -p benchmarks._instafail \
      -k "KdaVerifyCommit or KdaRecurrent or W4A16GroupedGemmGlu or Fp8Linear or Fp8QuantRows or attention" "$@" ;;
  flacfg)      # fla-core's autotune choices for this GPU, to commit under kestrel/kernels/kda/fla_configs/
    timeout 540 python3 -m kestrel.cli bench fla-configs --out "$OUT/fla_configs" 2>&1 | tee "$OUT/fla_configs.log" | tail -25 ;;
  nixl)       # the transport rows alone (no servers: pyzmq is all they need besides nixl)
    timeout 60 python3 benchmarks/disagg_bench.py --preset h200 --skip-serve --kv-transport nixl --device cuda \
      --budget-s 50 --repeat 3 --state-mb 16,64 --out "$OUT/disagg_transport_nixl.json" 2>&1 | grep -v INFO | tail -8 ;;
  profile)
    timeout 240 python3 benchmarks/decode_profile.py --model kl8 --batch 1 --batch 64 --prefill 8192 \
      --out "$OUT/profile_kl8.json" 2>&1 | tee "$OUT/profile.log" | grep -E -v "^\{|captured decode graph" | tail -90 ;;
  disagg)     # the bench's own --budget-s (400 s) stops it first; the timeout only backs it up
    timeout 480 python3 benchmarks/disagg_bench.py --preset h200 --out "$OUT/disagg_h200.json" "$@" 2>&1 | tee "$OUT/disagg.log" | grep -v "INFO" | tail -40 ;;
  spectest)
    TEST_TIMEOUT=240 LIMIT=560 bash "$0" diag tests/test_verify_graphs_cuda.py \
      tests/test_spec_targets.py::test_cuda_bf16_target_speculation_equals_plain \
      tests/test_spec_engine.py::test_cuda_speculation_equals_plain "$@" ;;
  kdadec)
    pytest_gpu kdadec 200 tests/test_fused_kda_decode.py "$@"
    LIMIT=150 bash benchmarks/gpu_certify.sh -p benchmarks._instafail -k "KdaDecode"
    timeout 200 python3 benchmarks/kda_decode_bench.py --sweep --json "$OUT/kda_decode.json" 2>&1 \
      | tee "$OUT/kda_decode.log" | tail -60 ;;
  specbench)
    mode=--quick; [ -n "${SPEC_FULL:-}" ] && mode=""
    timeout 560 python3 benchmarks/spec_bench.py $mode --out "$OUT/spec_k3.json" "$@" 2>&1 \
      | tee "$OUT/spec_k3.log" | grep -v "^{" | tail -30 ;;
esac
