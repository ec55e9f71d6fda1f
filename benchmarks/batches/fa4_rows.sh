#!/usr/bin/env bash
# What FlashAttention-4 changes, in one device call after `fa4_wheels.sh install` (same machine, PYTHONPATH as that
# script says). Usage: [NGPUS=2] bash benchmarks/batches/fa4_rows.sh OUT     (everything also in OUT.tgz)
# NGPUS (default 1): with 2 or more, steps 1 run on the first GPU and steps 2 on the second, side by side.
#   1. the baseline's attention alone: benchmarks/ops/attention.py's varlen_dup (the duplicated rows in one varlen call,
#      as the remove-padding baseline runs them) with torch's varlen_attn, then with FA4, beside SDPA-cuDNN and
#      dualkv's Gluon kernels, head dim 128: the kernels' speed against cuDNN's ("vs cuDNN" column)      ~2 x 60 s
#   2. a long-context row where attention weighs more (Qwen3-8B shape, 4 layers, 1 prompt of 8K x 8 responses of
#      1-2K), plain_varlen with each kernel and dualkv                                                  ~150 + 110 s
# (The 1K-prompt rows are left out: on the 8B one FA4 and torch's varlen_attn gave the same step, 357.5 / 358.0 ms,
# benchmarks/results/peers/h100-2026-11-27-fa4.) About 400 s of steps in all.
# Each step runs under its own timeout; steps.txt has each exit status (124: timed out).
set -u
OUT=${1:?usage: bash benchmarks/batches/fa4_rows.sh OUT}
NGPUS=${NGPUS:-1}
[ "$NGPUS" -ge 1 ] 2>/dev/null || { echo "fa4_rows.sh: NGPUS: expected a count of GPUs >= 1, got '$NGPUS'" >&2; exit 2; }
mkdir -p "$OUT"
step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
}
ATT=(benchmarks/ops/attention.py --skip-mask --shapes 16,4096,1024 --shapes 28,4096,2048 --shapes 8,8192,2048 --out "$OUT")
attention_rows() {  # steps 1
  step att_torch 75 env DUALKV_VARLEN_KERNEL=torch python3 "${ATT[@]}" --methods sdpa_cudnn_dup,varlen_dup,dualkv_gluon --stem attention_varlen_torch
  step att_fa4 60 env DUALKV_VARLEN_KERNEL=fa4 python3 "${ATT[@]}" --methods sdpa_cudnn_dup,varlen_dup --stem attention_varlen_fa4
}
PEERS=(benchmarks/peers/peers.py --device cuda --layers 4 --ragged --compile --iters 5)
long_rows() {  # steps 2
  step long_fa4 150 env DUALKV_VARLEN_KERNEL=fa4 python3 "${PEERS[@]}" --shape qwen3-8b --groups 1 --rollouts 8 \
    --prompt-len 8192 --response-len 2048 --sides plain_varlen,dualkv --out "$OUT/long_fa4"
  step long_torch 110 env DUALKV_VARLEN_KERNEL=torch python3 "${PEERS[@]}" --shape qwen3-8b --groups 1 --rollouts 8 \
    --prompt-len 8192 --response-len 2048 --sides plain_varlen --out "$OUT/long_torch"
}
if [ "$NGPUS" -ge 2 ]; then
  ( export CUDA_VISIBLE_DEVICES=0; attention_rows ) &
  ( export CUDA_VISIBLE_DEVICES=1; long_rows ) &
  wait
else
  attention_rows
  long_rows
fi
grep -hE "^## |varlen_dup|sdpa_cudnn_dup|dualkv_gluon" "$OUT"/attention_varlen_*.md 2>/dev/null
grep -hE "^\| (plain_varlen|dualkv) " "$OUT"/*/peers.md 2>/dev/null | cut -c1-160
rm -f "$OUT"/*.png
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
