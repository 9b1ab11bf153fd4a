#!/usr/bin/env bash
# Every multi-GPU run of the multi-GPU issue, one command each, results under $OUT (device
# tool) or benchmarks/results/multi-gpu. Usage: bash benchmarks/multi_gpu.sh [T]
set -uo pipefail
T=${1:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
OUT=${OUT:-benchmarks/results/multi-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 benchmarks/multi_gpu.py correctness --tp "$T" --out-dir "$OUT"
python3 benchmarks/multi_gpu.py capacity --tp "$T" --out-dir "$OUT"
python3 benchmarks/switch_overhead.py --backend cuda --tp "$T" --batch 16 --prompt-len 32768 \
    --rounds 3 --ckpt /tmp/splash-v3-shaped --out "$OUT/switch_overhead_tp$T.json"
python3 benchmarks/end_to_end.py --backend cuda --tp "$T" --trace rollout --n 256 \
    --max-prompt 8192 --max-output 8192 --out "$OUT/end_to_end_rollout_tp$T.json"
python3 benchmarks/end_to_end.py --backend cuda --tp "$T" --trace stationary --n 128 \
    --max-prompt 8192 --max-output 1024 --out "$OUT/end_to_end_stationary_tp$T.json"
python3 benchmarks/multi_gpu.py sweep --tp "$T" --out-dir "$OUT"
