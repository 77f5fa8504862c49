#!/usr/bin/env bash
# The 2-GPU runs (tests and benchmarks) in stages that each fit a 10-minute command:
#
#   bash scripts/gpu2_runs.sh tests        # every GPU test: one-GPU layer, then the NCCL (gpu2) layer
#   bash scripts/gpu2_runs.sh ring         # ring attention vs the fastest single-GPU kernel and context_parallel
#   bash scripts/gpu2_runs.sh features     # packed documents, sliding windows, softcap, padding
#   bash scripts/gpu2_runs.sh compile      # compiled collectives: tests, report and eager/compiled benchmark
#   bash scripts/gpu2_runs.sh profile      # the short-step (8k over 2 GPUs) profile
#   bash scripts/gpu2_runs.sh real         # every strategy on real links (scripts/bench_real.py), dense + packed
#   bash scripts/gpu2_runs.sh emulated     # the same rows on one GPU with emulated links, for the comparison
#
# "real" and "emulated" take the world from WORLD (default 2: 8k-64k tokens with and without the causal mask, and
# the packs, into real_w2.json); "real" also takes MESH=RxU (R rings x U-way Ulysses, R * U = WORLD) to run the
# hybrid strategies over that 2-D mesh too:
#   WORLD=4 MESH=2x2 bash scripts/gpu2_runs.sh real       # -> real_w4.json: packs, then 8k, 16k, 32k tokens per GPU
# SEQS (total dense tokens, e.g. 32k,64k,128k) and FULL=1 (dense rows also without the mask) override the rows.
# Logs and results go to $OUT (default ./gpu2_out). With flash-attn-4 installed (pip install "distcomm[fa4]")
# the fa4 backend and the FA4 single-GPU baseline are measured too; otherwise they are skipped with a reason.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu2_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export DISTCOMM_COMMIT=${DISTCOMM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
WORLD=${WORLD:-2}
MESH=${MESH:-}
if [[ $WORLD == 2 ]]; then
  SEQS=${SEQS:-8k,16k,32k,64k} FULL=${FULL:-1}
else
  SEQS=${SEQS:-$((8 * WORLD))k,$((16 * WORLD))k,$((32 * WORLD))k} FULL=${FULL:-0}
fi

case "${1:-}" in
  tests)
    timeout 280 python -m pytest -q -n 6 -m "gpu and not gpu2" tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
    timeout 300 python -m pytest -q -m gpu2 tests 2>&1 | tee "$OUT/gpu2_tests.log" | tail -5
    ;;
  ring)
    timeout 590 python scripts/bench_ring_attention.py --quick --seqs 8k,32k,128k --kernel-seqs 4k,8k,16k,32k \
      --budget 480 --out "$OUT" 2>&1 | tee "$OUT/ring.log" | tail -30
    ;;
  features)
    timeout 590 python scripts/bench_ring_features.py --budget 480 --out "$OUT" 2>&1 | tee "$OUT/features.log" | tail -30
    ;;
  compile)
    timeout 200 python -m pytest -q tests/test_compile.py 2>&1 | tee "$OUT/test_compile.log" | tail -3
    timeout 120 python scripts/compile_report.py --device cuda --backend inductor --out "$OUT/compile_report_nccl.md" \
      2>&1 | tail -5
    timeout 280 python scripts/bench_collectives.py --quick --compiled --sizes 1MB,16MB,128MB --repeats 3 --budget 220 \
      --out "$OUT/collectives_compiled" 2>&1 | tee "$OUT/collectives.log" | tail -30
    ;;
  profile)
    timeout 500 python scripts/profile_ring_attention.py --seqs 8k --iters 5 --out "$OUT" 2>&1 | tee "$OUT/profile.log" | tail -30
    ;;
  real)
    args=(--world "$WORLD" --seqs "$SEQS")
    [[ $FULL == 1 ]] && args+=(--full)
    [[ -n $MESH ]] && args+=(--mesh "$MESH")
    if [[ $WORLD == 2 ]]; then
      limit=420 log=real.log args+=(--docs one,lognormal,pareto)
    else  # packs first; rows that would start after 400 s are skipped, and the JSON is rewritten after each row
      limit=540 log=real_w$WORLD.log args+=(--docs lognormal,pareto,one --budget 400)
    fi
    timeout $limit python scripts/bench_real.py "${args[@]}" --out "$OUT/real_w$WORLD.json" 2>&1 \
      | tee "$OUT/$log" | grep -v Warning
    ;;
  emulated)
    dense=()
    for s in ${SEQS//,/ }; do
      n=${s%[kK]}
      [[ $n != "$s" ]] && n=$((n * 1024))
      dense+=("${n}x$WORLD")
    done
    cases=$(IFS=,; echo "${dense[*]}")
    if [[ $WORLD == 2 ]]; then limits=(150 100) log=emulated.log; else limits=(300 250) log=emulated_w$WORLD.log; fi
    timeout ${limits[0]} python scripts/bench_emulated.py --cases "$cases" --docs one --links nvlink \
      --strategies ring,allgather,ulysses --out "$OUT/emulated_w${WORLD}_dense.json" 2>&1 | tee "$OUT/$log"
    timeout ${limits[1]} python scripts/bench_emulated.py --cases "131072x$WORLD" --docs lognormal,pareto \
      --links nvlink --strategies ring,allgather,ulysses --out "$OUT/emulated_w${WORLD}_packed.json" 2>&1 \
      | tee -a "$OUT/$log"
    ;;
  *)
    sed -n 2,18p "$0"
    exit 2
    ;;
esac
