#!/usr/bin/env bash
# Issue 36's head dim 64 on an H100: the Gluon kernels' D=64 tiles were tuned on an H200, and two rows of
# benchmarks/attention.py reach 0.931 and 0.914 of cuDNN's fwd+bwd efficiency on an H100 (N=28 rows;
# benchmarks/results/attention_h100_2026-11-27/). One device call (nvidia-h100-x1, under 10 minutes): sweep the
# D=64 launch configs of the three kernels (benchmarks/gluon_tune.py), then the attention rows at D=64 with the
# defaults, for the before. Usage: bash benchmarks/d64_tune_h100.sh OUT
set -u
OUT=${1:?usage: bash benchmarks/d64_tune_h100.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
timeout 150 python3 benchmarks/gluon_tune.py dkdv --head-dim 64 \
  "block_n=128, block_m=64, stages=2; block_n=128, block_m=64, stages=3; block_n=128, block_m=32, stages=4; block_n=64, block_m=64, stages=3; block_n=64, block_m=64, stages=4; block_n=128, block_m=64, stages=2, consumer_regs=232" \
  > "$OUT/dkdv.txt" 2>&1
timeout 110 python3 benchmarks/gluon_tune.py dq --head-dim 64 \
  "stages=2; stages=3; stages=4; block_m=128, block_n=64, stages=3; block_m=128, block_n=128, stages=2" > "$OUT/dq.txt" 2>&1
timeout 90 python3 benchmarks/gluon_tune.py fwd --head-dim 64 \
  "block_m=128, block_n=128, stages=2; block_m=128, block_n=64, stages=3; block_m=128, block_n=128, stages=3" > "$OUT/fwd.txt" 2>&1
timeout 200 python3 benchmarks/attention.py --head-dim 64 --skip-mask --methods sdpa_cudnn_dup,dualkv_gluon \
  --shapes 28,4096,2048 --shapes 28,16384,1024 --shapes 16,4096,1024 --out "$OUT" --stem attention_d64_defaults > "$OUT/attention.txt" 2>&1
tail -n 25 "$OUT"/dkdv.txt "$OUT"/dq.txt "$OUT"/fwd.txt
grep -i "vs cudnn\|gluon" "$OUT"/attention_d64_defaults.md | head -12
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
