#!/usr/bin/env bash
# One call on a 4-GPU machine, runs chosen to fill one 10-minute device call. Usage: bash benchmarks/gpu_batch_x4.sh OUT [BATCH]
#   BATCH q17 (default; 2026-11-27's first call), runs side by side on disjoint GPUs:
#     GPU 0     fsdp_sp_gpu.sh q17_1gpu, then q17_fp32 (issue 37 (a) at the final code; float32 gradient parity)
#     GPU 1,2   fsdp_sp_gpu.sh q17_per_layer, then grad_bf16_check.py (cuda) and tests/test_shared_token_precision.py
#     GPU 3     trl_grpo_gpu.py (issue 34 (a)), TRL and datasets from carried wheels
#   BATCH sp, one after the other on all 4 GPUs: fsdp_sp_gpu.sh sp4 (issue 37 (b), the 64K prompt at sp 4), then
#     fsdp_sp_gpu.sh headline (issue 36, all 36 layers) with what is left of TOTAL_S (default 580 s)
# Each run compares its sides inside one process, so neighbours on other GPUs load both sides alike; the host's
# CPUs are shared (64 cores). Everything goes into one archive beside OUT (the device tool brings back few files).
set -u
OUT=$1
BATCH=${2:-q17}
mkdir -p "$OUT"
export PYTHONPATH="$PWD"
start=$(date +%s)
case "$BATCH" in
  q17)
    mkdir -p "$OUT/trl" "$OUT/grad" "$OUT/q17"
    ( CUDA_VISIBLE_DEVICES=0 LIMIT=270 bash benchmarks/fsdp_sp_gpu.sh "$OUT/q17" q17_1gpu
      CUDA_VISIBLE_DEVICES=0 bash benchmarks/fsdp_sp_gpu.sh "$OUT/q17" q17_fp32 ) > "$OUT/gpu0.txt" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=1,2 LIMIT=280 bash benchmarks/fsdp_sp_gpu.sh "$OUT/q17" q17_per_layer
      CUDA_VISIBLE_DEVICES=1 timeout 200 python3 benchmarks/grad_bf16_check.py --device cuda --shape qwen3-0.6b --out "$OUT/grad"
      CUDA_VISIBLE_DEVICES=2 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_shared_token_precision.py ) > "$OUT/gpu12.txt" 2>&1 &
    ( python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      CUDA_VISIBLE_DEVICES=3 PYTHONPATH=/tmp/site:$PWD timeout 540 python3 benchmarks/trl_grpo_gpu.py --out "$OUT/trl" ) > "$OUT/gpu3.txt" 2>&1 &
    wait
    tail -5 "$OUT/gpu0.txt" "$OUT/gpu12.txt" "$OUT/gpu3.txt" ;;
  sp)
    LIMIT=${SP4_S:-240} bash benchmarks/fsdp_sp_gpu.sh "$OUT" sp4
    left=$(( ${TOTAL_S:-580} - ($(date +%s) - start) ))
    echo "== sp4 done after $(($(date +%s) - start)) s; headline gets ${left} s"
    LIMIT=$left bash benchmarks/fsdp_sp_gpu.sh "$OUT" headline ;;
  *) echo "gpu_batch_x4.sh: unknown BATCH '$BATCH' (q17 or sp)" >&2; exit 2 ;;
esac
echo "== batch $BATCH done after $(($(date +%s) - start)) s"
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
