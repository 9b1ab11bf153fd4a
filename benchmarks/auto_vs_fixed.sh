#!/usr/bin/env bash
# Calibrate the cost model on this machine, then serve the four end-to-end traces with
# layout="auto" (using that profile) and with every fixed layout: one device call on 2 GPUs.
#
#   bash benchmarks/auto_vs_fixed.sh [T]
#
# Writes under $OUT (device tool) or benchmarks/results/h200x<T>: calibrate.log, end_to_end.log
# and results.tgz (calibration_tp<T>.json/.txt, end_to_end_<trace>_tp<T>.json/.png), so few
# files come back. CAL_TIMEOUT (default 200 s) bounds calibration; the traces get what is left of
# BUDGET (default 570 s, the whole script) unless E2E_TIMEOUT says otherwise. Every trace's JSON
# is rewritten after each layout's engine, so a cut run still leaves the runs done.
set -uo pipefail
T=${1:-2}
OUT=${OUT:-benchmarks/results/h200x$T}
RES=/tmp/splash-auto-vs-fixed
CKPT=/tmp/splash-v3-8l-o1
mkdir -p "$OUT" "$RES"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried to a bare machine: this repo's + deps
  pip install -q --no-deps --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
t0=$(date +%s)
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import multi_gpu; \
multi_gpu.build('$CKPT', 8, 32)" || exit 1
echo "== checkpoint ready after $(( $(date +%s) - t0 )) s"
timeout "${CAL_TIMEOUT:-200}" python3 -m splash.cli calibrate --backend cuda --tp "$T" \
  --model "$CKPT" --out "$RES/calibration_tp$T.json" > "$OUT/calibrate.log" 2>&1
echo "== calibrate: exit $? after $(( $(date +%s) - t0 )) s"
grep -E "error: rms|Error" "$OUT/calibrate.log" | tail -n 8
CAL=()
[ -f "$RES/calibration_tp$T.json" ] && CAL=(env "SPLASH_CALIBRATION=$RES/calibration_tp$T.json")
left=$(( ${BUDGET:-570} - ($(date +%s) - t0) ))
timeout "${E2E_TIMEOUT:-$(( left > 60 ? left : 60 ))}" "${CAL[@]}" python3 benchmarks/end_to_end.py --backend cuda \
  --tp "$T" --trace all --ckpt "$CKPT" --out-dir "$RES" > "$OUT/end_to_end.log" 2>&1
echo "== end_to_end: exit $? after $(( $(date +%s) - t0 )) s"
grep -E "tokens/s|Error" "$OUT/end_to_end.log" | tail -n 30
tar czf "$OUT/results.tgz" -C "$RES" .
