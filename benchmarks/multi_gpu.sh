#!/usr/bin/env bash
# The multi-GPU runs of the multi-GPU issue, results under $OUT (device tool) or
# benchmarks/results/multi-gpu, one log per run beside its JSON.
#
#   bash benchmarks/multi_gpu.sh [T] [RUN ...]
#
# RUN: correctness roofline capacity transfer switch e2e sweep (default: all, in that order; a device
# call of 10 minutes fits correctness + capacity, the others need a call each). A failing run
# does not stop the next; RUN_TIMEOUT (seconds, default 560) bounds each one.
set -uo pipefail
T=${1:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
shift || true
RUNS=${*:-correctness roofline capacity transfer switch e2e sweep}
OUT=${OUT:-benchmarks/results/multi-gpu}
RUN_TIMEOUT=${RUN_TIMEOUT:-560}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
CKPT=/tmp/splash-v3-8l-o1

ckpt() {  # the DeepSeek-V3-shaped checkpoint every GPU run uses (written once per machine)
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import multi_gpu; \
multi_gpu.build('$CKPT', 8, 32)" || exit 1
}

run() {  # name, command...
  local name=$1
  shift
  echo "== $name (T=$T): $*"
  timeout "$RUN_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$OUT/$name.log"
  echo "== $name: exit $rc"
}

ckpt
for r in $RUNS; do
  case $r in
    correctness|capacity|sweep)
      run "$r" python3 benchmarks/multi_gpu.py "$r" --tp "$T" --out-dir "$OUT" ;;
    roofline)
      run roofline python3 benchmarks/step_roofline.py --tp "$T" --model "$CKPT" \
        --out "$OUT/step_roofline.json" ;;
    transfer)
      run transfer python3 benchmarks/transfer_bw.py --tp "$T" --batch 16 --context 32768 \
        --layers 8 --out "$OUT/transfer_bw_tp$T.json" ;;
    switch)
      run switch python3 benchmarks/switch_overhead.py --backend cuda --tp "$T" --batch 16 \
        --prompt-len 32768 --rounds 3 --ckpt "$CKPT" --out "$OUT/switch_overhead_tp$T.json" ;;
    e2e)
      run e2e python3 benchmarks/end_to_end.py --backend cuda --tp "$T" --ckpt "$CKPT" \
        --trace all --out-dir "$OUT" ;;  # calibrated: benchmarks/auto_vs_fixed.sh
    *) echo "unknown run $r (correctness roofline capacity transfer switch e2e sweep)"; exit 2 ;;
  esac
done
