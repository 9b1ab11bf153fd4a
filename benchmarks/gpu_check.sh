#!/usr/bin/env bash
# One-GPU check after kernel or engine changes, results under $OUT (device tool) or
# benchmarks/results/h200-check, one log per part beside its JSON.
#
#   bash benchmarks/gpu_check.sh [PART ...]
#
# PART: tests (GPU kernel + CUDA-graph tests, the CPU tier's kernel tests compiled, the memory
# tests, then the multi-rank tests with CUDA tensors over gloo), engine (bf16 / fp8 KV vs fp32
# transformers), kernels (benchmarks/kernel_bench.py, no sweep),
# moe (fused MoE, default config), offline (throughput vs transformers), profile (ncu),
# prefix (prefix caching and n samples on GRPO and agent traces, V2-Lite dims), small (the fused
# norm, rope and routing kernels against the torch ops they replace), dsa (launch sweep of the
# DSA kernels, then their records), gemms (the dense products of a decode step vs their bytes),
# overlap (T=1 decode steps with one and with two streams per layer, V3-shaped, 8 layers),
# expanded (one prefill chunk's attention absorbed vs expanded: SPLASH_MHA_PREFILL's default),
# prefill_ab (offline throughput with every prefill absorbed, then with the default), first
# (Triton compiles after start-up, cold cache, V3 and V3.2 shapes, 24K prompts).
# Default: tests engine kernels moe offline (about 8 minutes on an H200 before the compiled
# kernel tests joined "tests").
set -uo pipefail
PARTS=${*:-tests engine kernels moe offline}
OUT=${OUT:-benchmarks/results/h200-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0

part() {  # name, timeout, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "passed|failed|error|top1|\"batch\"|summary|Error|grpo|agentic" "$OUT/$name.log" | tail -n 12
  echo "== $name: exit $rc"
}

for p in $PARTS; do
  case $p in
    tests)
      part gpu_tests 200 env SPLASH_TEST_GPU=1 python3 -m pytest -q -m gpu -n 6 tests/kernels \
        tests/reference/test_cuda_graphs.py
      # the CPU tier's kernel tests, compiled for the GPU (no CI leg runs them so; they found
      # three test bugs in the DSA files)
      part kernels_compiled 300 env -u TRITON_INTERPRET SPLASH_TEST_GPU=1 python3 -m pytest -q \
        -m "not gpu" -n 6 tests/kernels
      part memory_tests 300 env SPLASH_TEST_GPU=1 python3 -m pytest -q -m gpu \
        tests/reference/test_memory_gpu.py
      part dist_tests 150 env SPLASH_TEST_GPU=1 SPLASH_TEST_BACKEND=cuda SPLASH_DIST_BACKEND=gloo \
        SPLASH_TEST_DTYPE=fp32 python3 -m pytest -q -n 8 tests/dist -k "not dead" ;;
    engine) part engine 120 python3 benchmarks/gpu_engine_check.py --out "$OUT/engine_bf16.json" ;;
    kernels) part kernels 300 python3 benchmarks/kernel_bench.py --out "$OUT/kernels.json" --no-sweep ;;
    moe) part moe 120 python3 benchmarks/moe_kernel.py --out "$OUT/moe_kernel.json" --no-sweep ;;
    small) part small_ops 120 python3 benchmarks/small_ops.py --out "$OUT/small_ops.json" ;;
    offline) part offline 240 python3 benchmarks/offline_throughput.py \
      --out "$OUT/offline_throughput.json" ;;
    profile) part profile 300 bash benchmarks/profile_kernels.sh "$OUT/profile" ;;
    prefix) part prefix_cache 1200 python3 benchmarks/prefix_cache.py --backend cuda \
      --full-dims --layers 4 --prompts 64 --n 8 --template 1024 --question 512 --output 1024 \
      --page-size 64 --batch-tokens 8192 --sessions 32 --turns 6 --context 8192 --turn-len 1024 \
      --out "$OUT/prefix_cache.json" ;;
    dsa) part dsa 540 python3 benchmarks/dsa_sweep.py --out "$OUT/dsa_sweep.json" ;;
    gemms) part gemms 120 python3 benchmarks/dense_gemms.py --out "$OUT/dense_gemms.json" ;;
    expanded) part expanded_prefill 240 python3 benchmarks/expanded_prefill.py \
      --out "$OUT/expanded_prefill.json" ;;
    prefill_ab)
      part offline_absorbed 240 env SPLASH_MHA_PREFILL=off python3 benchmarks/offline_throughput.py \
        --out "$OUT/offline_absorbed.json"
      part offline_expanded 240 python3 benchmarks/offline_throughput.py \
        --out "$OUT/offline_expanded.json" ;;
    first) part first_requests 330 env TRITON_CACHE_DIR=/tmp/splash-cold-cache \
      python3 benchmarks/first_requests.py --layers 2 --long 24000 \
      --out "$OUT/first_requests.json" ;;
    overlap)
      CKPT=/tmp/splash-v3-8l-o1
      python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import multi_gpu; \
multi_gpu.build('$CKPT', 8, 32)"
      part step_one_stream 200 env SPLASH_OVERLAP=0 python3 benchmarks/step_roofline.py --tp 1 \
        --model "$CKPT" --batches 1,16,64 --contexts 1024 --out "$OUT/step_one_stream.json"
      part step_two_streams 200 python3 benchmarks/step_roofline.py --tp 1 \
        --model "$CKPT" --batches 1,16,64 --contexts 1024 --out "$OUT/step_two_streams.json" ;;
    *) echo "unknown part $p (tests engine kernels moe offline profile prefix small dsa gemms" \
      "expanded prefill_ab first overlap)"; exit 2 ;;
  esac
done
