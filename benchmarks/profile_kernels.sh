#!/usr/bin/env bash
# Nsight Compute profiles of SPLASH's main Triton kernels, one small driver run per case
# (benchmarks/profile_driver.py), and one combined summary.
#
#   bash benchmarks/profile_kernels.sh OUTDIR [CASE ...]
#
# (default: every case; python benchmarks/profile_driver.py --list shows them)
#
# Per case: ncu profiles only the case's main kernel (--kernel-name regex, the warm-up launches
# skipped with --launch-skip, --launch-count = launches per call) with the SpeedOfLight, Occupancy,
# LaunchStats, MemoryWorkloadAnalysis, ComputeWorkloadAnalysis, WarpStateStats and SourceCounters
# sections (the warp-stall samples of every SASS instruction: CASE.stalls.json, by
# benchmarks/stall_sites.py, and a few lines of it in the summary), plus
# DRAM bytes/s, local-memory (spill) traffic and tensor-pipe utilisation where this ncu has those
# metrics; clocks are left as they run (--clock-control none), so durations compare with the
# benchmarks; the report is exported as CSV (--csv --page details). A case that fails does not stop
# the others; without ncu (or without permission to read the GPU counters) each case is timed
# instead. OUTDIR ends with three files: summary.txt (the table), summary.json and raw.tgz (the
# .ncu-rep reports, CSVs and logs). NCU=/path/to/ncu and PYTHON=... override the tools;
# CASE_TIMEOUT (seconds, default 150) bounds each case.
set -u

OUTDIR=${1:?usage: bash benchmarks/profile_kernels.sh OUTDIR [CASE ...]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
DRIVER="$HERE/profile_driver.py"
CASE_TIMEOUT=${CASE_TIMEOUT:-150}
WARM=3  # = profile_driver.WARM
mkdir -p "$OUTDIR" || exit 1
START=$(date +%s)

NCU=${NCU:-}
if [ -z "$NCU" ]; then
  if command -v ncu >/dev/null 2>&1; then
    NCU=$(command -v ncu)
  elif [ -x /usr/local/cuda/bin/ncu ]; then
    NCU=/usr/local/cuda/bin/ncu
  else
    for c in /usr/local/cuda-*/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
      [ -x "$c" ] && NCU=$c
    done
  fi
fi
if [ -n "$NCU" ]; then
  echo "ncu: $NCU ($("$NCU" --version 2>/dev/null | tail -n 1))"
else
  echo "ncu not found (PATH, /usr/local/cuda/bin): timing the cases instead of profiling them"
fi

# optional metrics, only those this ncu knows (an unknown name would abort the run)
METRICS=""
if [ -n "$NCU" ]; then
  "$NCU" --query-metrics > "$OUTDIR/ncu_metrics.txt" 2>&1 || true
  have() { grep -q "^$1[[:space:]]" "$OUTDIR/ncu_metrics.txt"; }
  add() { METRICS="${METRICS:+$METRICS,}$1"; }
  have dram__bytes && add dram__bytes.sum.per_second
  have l1tex__t_bytes_pipe_lsu_mem_local_op_ld && add l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum
  have l1tex__t_bytes_pipe_lsu_mem_local_op_st && add l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum
  for base in sm__pipe_tensor_cycles_active sm__pipe_tensor_op_hmma_cycles_active; do
    if have "$base"; then add "$base.avg.pct_of_peak_sustained_active"; break; fi
  done
  # why warps wait: cycles stalled per issued instruction, by reason
  for r in long_scoreboard short_scoreboard barrier wait mio_throttle lg_throttle \
           math_pipe_throttle not_selected no_instruction membar dispatch_stall; do
    m=smsp__average_warps_issue_stalled_${r}_per_issue_active
    have "$m" && add "$m.ratio"
  done
  echo "extra metrics: ${METRICS:-none}"
fi

if [ $# -gt 0 ]; then
  CASES=("$@")
else
  mapfile -t CASES < <("$PY" "$DRIVER" --list | cut -d' ' -f1)
fi
if [ ${#CASES[@]} -eq 0 ]; then
  echo "no cases (is splash installed? try: $PY $DRIVER --list)"
  exit 1
fi

NO_COUNTERS=0
for case in "${CASES[@]}"; do
  line=$("$PY" "$DRIVER" --list | grep "^$case " || true)
  if [ -z "$line" ]; then
    echo "CASE_STATUS $case: unknown case" | tee "$OUTDIR/$case.log"
    continue
  fi
  read -r _ regex launches _ <<< "$line"
  log="$OUTDIR/$case.log"
  echo "== $case (regex $regex, launches $launches) $(( $(date +%s) - START ))s"
  ok=0
  if [ -n "$NCU" ] && [ $NO_COUNTERS -eq 0 ]; then
    args=(--kernel-name "regex:$regex" --launch-skip $((WARM * launches))
          --launch-count "$launches" --clock-control none
          --section SpeedOfLight --section Occupancy --section LaunchStats
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
          --section WarpStateStats --section SourceCounters)
    [ -n "$METRICS" ] && args+=(--metrics "$METRICS")
    timeout "$CASE_TIMEOUT" "$NCU" "${args[@]}" -f -o "$OUTDIR/$case" \
      "$PY" "$DRIVER" "$case" > "$log" 2>&1
    rc=$?
    if [ -f "$OUTDIR/$case.ncu-rep" ]; then
      if "$NCU" --import "$OUTDIR/$case.ncu-rep" --csv --page details > "$OUTDIR/$case.csv" \
          2>> "$log"; then
        ok=1
      else
        echo "CASE_STATUS $case: CSV export failed" >> "$log"
      fi
      "$NCU" --import "$OUTDIR/$case.ncu-rep" --csv --page source --print-source sass \
        > "$OUTDIR/$case.source.csv" 2>> "$log" \
        && "$PY" "$HERE/stall_sites.py" "$OUTDIR/$case.source.csv" \
             --out "$OUTDIR/$case.stalls.json" > /dev/null 2>> "$log" \
        || echo "CASE_STATUS $case: no stall sites (source page export)" >> "$log"
    else
      echo "CASE_STATUS $case: ncu rc=$rc, no report (last lines of the log below)" >> "$log"
      tail -n 5 "$log" | sed 's/^/    /'
      if grep -q "ERR_NVGPUCTRPERM" "$log"; then
        echo "CASE_STATUS no permission to read GPU performance counters (ERR_NVGPUCTRPERM):" \
             "timing the remaining cases instead" >> "$log"
        NO_COUNTERS=1
      fi
    fi
  fi
  if [ $ok -eq 0 ]; then
    timeout "$CASE_TIMEOUT" "$PY" "$DRIVER" "$case" --time >> "$log" 2>&1 \
      || echo "CASE_STATUS $case: timing run failed (rc=$?)" >> "$log"
  fi
  grep -E "^(TIMING|CASE_STATUS)" "$log" | sed 's/^/    /'
done

"$PY" "$DRIVER" --summarise "$OUTDIR" || echo "summariser failed"
# pack the per-case files, so OUTDIR holds summary.txt, summary.json and raw.tgz
( cd "$OUTDIR" && shopt -s nullglob && files=(*.ncu-rep *.csv *.log *.stalls.json ncu_metrics.tx[t]) \
  && [ ${#files[@]} -gt 0 ] && tar -czf raw.tgz "${files[@]}" && rm -f "${files[@]}" )
echo "done in $(( $(date +%s) - START ))s: $OUTDIR/summary.txt"
