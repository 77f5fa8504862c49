#!/usr/bin/env bash
# Nsight Compute profile of ONE launch each of our Triton forward (final step) and backward kernels and of
# cuDNN's forward and backward, S=8192 (or $S), causal and full, bf16, B=1, 32 heads, head_dim 128.
#
#     OUT=/path/to/out bash scripts/profile_triton_kernels.sh        # on the GPU machine, from the repo root
#
# Writes to $OUT: summary.txt / summary.csv (per kernel: case, duration, SM throughput %, tensor (GMMA)
# pipe %, issue-active %, DRAM %, registers/thread, block/grid, dynamic smem, theoretical and achieved
# occupancy, local-memory (spill) bytes, top-4 warp stall reasons), raw.csv (every collected metric),
# details.csv (the sections' details page), attn_profile.ncu-rep, and the logs.
# Clocks are left alone (--clock-control none) so durations match the benchmarks' conditions.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/profile_out}
S=${S:-8192}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}

# 1. Compile and warm everything outside the profiler (Triton compiles slowly under ncu).
timeout 150 python scripts/_profile_driver.py --seq "$S" --no-profile --out "$OUT" > "$OUT/warmup.log" 2>&1 \
    || echo "warm-up failed or timed out (see $OUT/warmup.log); profiling anyway" >&2

# 2. Optional metrics, only those this ncu knows for gh100 (an unknown metric name aborts a profile).
known=$(timeout 60 ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}')
metrics=""
for pair in sm__pipe_tensor_op_gmma_cycles_active:avg.pct_of_peak_sustained_active \
            sm__pipe_tensor_op_hmma_cycles_active:avg.pct_of_peak_sustained_active \
            sm__inst_executed_pipe_tensor_op_gmma:sum \
            sm__inst_issued:avg.pct_of_peak_sustained_active \
            l1tex__t_bytes_pipe_lsu_mem_local_op_ld:sum \
            l1tex__t_bytes_pipe_lsu_mem_local_op_st:sum \
            dram__throughput:avg.pct_of_peak_sustained_elapsed; do
    base=${pair%%:*}
    if grep -qx "$base" <<<"$known"; then metrics+="${metrics:+,}$base.${pair#*:}"; fi
done
echo "extra metrics: ${metrics:-none}" | tee "$OUT/metrics.txt"

# 3. Profile: only the kernels between cudaProfilerStart/Stop in the driver (one call per case).
timeout 240 ncu --clock-control none --profile-from-start off --nvtx --target-processes all \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
    ${metrics:+--metrics "$metrics"} -f -o "$OUT/attn_profile" \
    python scripts/_profile_driver.py --seq "$S" --out "$OUT" > "$OUT/ncu.log" 2>&1
echo "ncu exit code $?" | tee -a "$OUT/ncu.log"

# 4. Export and summarize.
rep="$OUT/attn_profile.ncu-rep"
if [ -f "$rep" ]; then
    ncu --import "$rep" --page raw --csv > "$OUT/raw.csv" 2> "$OUT/export.log"
    ncu --import "$rep" --page raw --csv --print-nvtx-rename kernel > "$OUT/raw_nvtx.csv" 2>> "$OUT/export.log" \
        || rm -f "$OUT/raw_nvtx.csv"
    ncu --import "$rep" --page details --csv > "$OUT/details.csv" 2>> "$OUT/export.log"
    python scripts/_profile_driver.py --summarize "$OUT" || echo "summary failed; see raw.csv" >&2
else
    echo "no report written; see $OUT/ncu.log" >&2
    tail -20 "$OUT/ncu.log" >&2
fi
