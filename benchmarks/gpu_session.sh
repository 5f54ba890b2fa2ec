#!/usr/bin/env bash
# One short GPU session in two calls (a device command runs at most 10 minutes), in order of importance:
#   checks   the fused head + cross-entropy kernels compiled for real against their reference, then the backend end
#            to end on the GPU (CUDA graphs on, the default)                                  (at most 4.5 minutes)
#   measure  the LM loss benchmark (adjoint with the fused head by default, as written, and torch.compile), then
#            the kernels' tile sizes swept alone (benchmarks/lce_kernels.py)                    (at most 7 minutes)
#   dp       (if time is left) the clipped step of per_sample_clip on the same LM, B = 2, beside the non-private
#            adjoint step                                                                       (at most 4 minutes)
# Each step has its own time limit so that a slow one leaves the others their turn; logs and JSON go to $OUT (the
# device tool's folder) or benchmarks/results.
#
#     OUT=/some/dir bash benchmarks/gpu_session.sh checks
#     OUT=/some/dir bash benchmarks/gpu_session.sh measure
#     OUT=/some/dir bash benchmarks/gpu_session.sh dp
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
case "${1:-}" in
  checks)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu_session.log"
    timeout 120 $PY benchmarks/gpu_check.py --lce-only 2>&1 | tee "$OUT/gpu_check_lce.log"
    timeout 150 $PY benchmarks/gpu_check.py --backend-only --graphs 2>&1 | tee "$OUT/gpu_check_fused_graphs.log"
    ;;
  measure)
    timeout 300 $PY benchmarks/lm_loss.py --device cuda --repeats 3 --methods adjoint,adjoint-unfused,compile \
        --vocab 32000,50257 --lengths 2048,8192,16384,32768 --out "$OUT" 2>&1 | tee "$OUT/lm_loss_fused.log"
    timeout 120 $PY benchmarks/lce_kernels.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/lce_kernels.log"
    ;;
  dp)
    timeout 240 $PY benchmarks/lm_loss.py --device cuda --repeats 3 --methods adjoint,adjoint-dp --batch 2 \
        --vocab 32000 --lengths 2048,8192,16384 --out "$OUT/dp" 2>&1 | tee "$OUT/lm_loss_dp.log"
    ;;
  *)
    echo "usage: OUT=DIR bash benchmarks/gpu_session.sh checks|measure|dp" >&2
    exit 2
    ;;
esac
