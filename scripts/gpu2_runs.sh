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
# Logs and results go to $OUT (default ./gpu2_out). With flash-attn-4 installed (pip install "distcomm[fa4]")
# the fa4 backend and the FA4 single-GPU baseline are measured too; otherwise they are skipped with a reason.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu2_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export DISTCOMM_COMMIT=${DISTCOMM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

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
    timeout 420 python scripts/bench_real.py --world 2 --seqs 8k,16k,32k,64k --full --docs one,lognormal,pareto \
      --out "$OUT/real_w2.json" 2>&1 | tee "$OUT/real.log" | grep -v Warning
    ;;
  emulated)
    timeout 150 python scripts/bench_emulated.py --cases 8192x2,16384x2,32768x2,65536x2 --docs one --links nvlink \
      --strategies ring,allgather,ulysses --out "$OUT/emulated_w2_dense.json" 2>&1 | tee "$OUT/emulated.log"
    timeout 100 python scripts/bench_emulated.py --cases 131072x2 --docs lognormal,pareto --links nvlink \
      --strategies ring,allgather,ulysses --out "$OUT/emulated_w2_packed.json" 2>&1 | tee -a "$OUT/emulated.log"
    ;;
  *)
    sed -n 2,13p "$0"
    exit 2
    ;;
esac
