#!/usr/bin/env bash
# One short GPU session in two calls (a device command runs at most 10 minutes), in order of importance, or in one:
#   checks   the fused head + cross-entropy kernels compiled for real against their reference, then the backend end
#            to end on the GPU (CUDA graphs on, the default)                                  (at most 4.5 minutes)
#   measure  the LM loss benchmark (adjoint with the fused head by default, as written, and torch.compile), then
#            the kernels' tile sizes swept alone (benchmarks/lce_kernels.py)                    (at most 7 minutes)
#   all      the kernels' check, their time at "highest" (three TF32 products, or plain fp32) and "high", the LM
#            benchmark (adjoint with and without CUDA graphs, compile), the backend's check, transformers' Mamba with
#            loss_only against torch.compile at T = 8192, in one call of at most 9.6 minutes; the logs and JSON are
#            packed into $OUT/gpu_all.tar.gz (the device tool brings back at most 8 files)
#   pool     (if time is left) what the graphs' pool holds with the fused head, and the LM step with shards and
#            loss chunks of at least 16 or 32 MiB (graphs on): whether smaller shards bring the pool under the memory
#            target at an affordable step                                                     (at most 2.7 minutes)
#   dp       (if time is left) the clipped step of per_sample_clip on the same LM, B = 2, beside the non-private
#            adjoint step                                                                       (at most 4 minutes)
# Each step has its own time limit so that a slow one leaves the others their turn; logs and JSON go to $OUT (the
# device tool's folder) or benchmarks/results.
#
#     OUT=/some/dir bash benchmarks/gpu_session.sh checks
#     OUT=/some/dir bash benchmarks/gpu_session.sh measure
#     OUT=/some/dir bash benchmarks/gpu_session.sh all
#     OUT=/some/dir bash benchmarks/gpu_session.sh pool
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
  all)
    W=$(mktemp -d)
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      $PY -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)"
    } > "$W/gpu_session.log" 2>&1
    timeout 75 $PY benchmarks/gpu_check.py --lce-only > "$W/gpu_check_lce.log" 2>&1
    timeout 60 $PY benchmarks/lce_kernels.py --device cuda --sizes 16384x32000 --precisions highest,highest:ieee,high \
        --configs 0,3 --no-compile --repeats 3 --out "$W" > "$W/lce_kernels.log" 2>&1
    timeout 240 $PY benchmarks/lm_loss.py --device cuda --repeats 3 --methods adjoint,compile,adjoint-graphs \
        --vocab 32000,50257 --lengths 2048,8192,16384,32768 --out "$W" > "$W/lm_loss_fused.log" 2>&1
    timeout 100 $PY benchmarks/gpu_check.py --backend-only --graphs > "$W/gpu_check_fused_graphs.log" 2>&1
    timeout 100 $PY benchmarks/hf_loss_only.py --device cuda --methods compile,adjoint+loss_only --lengths 8192 \
        --warmup 1 --repeats 3 --timeout 90 --out "$W" --tag _cuda > "$W/hf_loss_only.log" 2>&1
    grep -h "^ok\|^FAIL\|off tolerance\|: peak\|V=.*target\|step adjoint\|method=" "$W"/*.log > "$OUT/summary.txt"
    tar czf "$OUT/gpu_all.tar.gz" -C "$W" .
    ;;
  pool)
    timeout 50 $PY benchmarks/graph_pool.py 32000 16384 2>&1 | tee "$OUT/graph_pool.log"
    timeout 110 $PY benchmarks/lm_loss.py --device cuda --repeats 3 --methods adjoint@16,adjoint@32 --vocab 32000 \
        --lengths 8192,16384 --out "$OUT" 2>&1 | tee "$OUT/lm_loss_pool.log"
    ;;
  dp)
    timeout 240 $PY benchmarks/lm_loss.py --device cuda --repeats 3 --methods adjoint,adjoint-dp --batch 2 \
        --vocab 32000 --lengths 2048,8192,16384 --out "$OUT/dp" 2>&1 | tee "$OUT/lm_loss_dp.log"
    ;;
  *)
    echo "usage: OUT=DIR bash benchmarks/gpu_session.sh checks|measure|all|pool|dp" >&2
    exit 2
    ;;
esac
