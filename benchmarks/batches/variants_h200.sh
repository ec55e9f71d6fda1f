#!/usr/bin/env bash
# Issue 49's GPU work on one H200, in two device calls (each under 10 minutes). Usage:
#   bash benchmarks/batches/variants_h200.sh OUT kernels   # the GPU tests of the attention variants, then
#                                                           # window_attention.py (binding windows vs flex/cuDNN)
#   bash benchmarks/batches/variants_h200.sh OUT models    # model_variants.py: gpt-oss-20b, DeepSeek-V2-Lite shapes
# Logs and results go to OUT (the device tool brings back at most 8 files: one log per step, the benches' files).
set -u
OUT=$1
STEP=$2
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
{ nvidia-smi -L; python3 -c 'import torch, triton, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)'; date -u; } > "$OUT/env.txt" 2>&1
case "$STEP" in
kernels)
  timeout 330 python3 -m pytest -q -x -p no:cacheprovider -m "cuda or not cuda" \
    tests/kernels/test_gpu_sinks_windows.py tests/kernels/test_triton_windows.py tests/kernels/test_windows_sinks.py \
    tests/kernels/test_attention_variants.py tests/kernels/test_gluon_attention.py tests/ops/test_flex.py \
    tests/ops/test_attention_variants.py tests/ops/test_backend_choice.py > "$OUT/gpu_tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/gpu_tests.log"
  timeout 200 python3 benchmarks/ops/window_attention.py --out "$OUT" > "$OUT/window_attention.log" 2>&1
  echo "window_attention rc=$?" >> "$OUT/window_attention.log"
  ;;
models)
  timeout 300 python3 benchmarks/model/model_variants.py --model gpt-oss-20b --out "$OUT" > "$OUT/gpt_oss.log" 2>&1
  echo "gpt-oss rc=$?" >> "$OUT/gpt_oss.log"
  timeout 270 python3 benchmarks/model/model_variants.py --model deepseek-v2-lite --out "$OUT" > "$OUT/deepseek.log" 2>&1
  echo "deepseek rc=$?" >> "$OUT/deepseek.log"
  ;;
*) echo "variants_h200.sh: STEP must be kernels or models, got $STEP" >&2; exit 2 ;;
esac
