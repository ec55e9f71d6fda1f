#!/usr/bin/env bash
# examples/fsdp_grpo.py on 2 GPUs (NCCL): FSDP2 on the root, per layer, and sequence parallelism (--sp 2),
# each against the plain step on the same shape. Logs and each run's fsdp_grpo.md/json go under $1 (default
# ./fsdp_sp_runs); the last lines of each log are printed. Usage: bash benchmarks/fsdp_sp_gpu.sh OUTDIR
set -u
OUT=${1:-fsdp_sp_runs}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout (not installed there)
SHAPE="--device cuda --mode fsdp --bf16 --layers 4 --hidden 1024 --heads 16 --kv-heads 8 --vocab 32000 --prompts 2 --rollouts 8 --prompt-len 1024 --response-len 256 --iters 5"
run() {
  name=$1; shift
  echo "=== $name: $*" | tee "$OUT/$name.log"
  PYTHONUNBUFFERED=1 timeout 170 torchrun --nproc-per-node 2 examples/fsdp_grpo.py "$@" --out "$OUT/$name" >>"$OUT/$name.log" 2>&1
  echo "exit $?" >>"$OUT/$name.log"
  grep -E "fsdp_grpo:|parity|Error|error:" "$OUT/$name.log" | grep -v Warning | tail -4
}
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count())"
run sp2 $SHAPE --sp 2
run root $SHAPE
run per_layer $SHAPE --per-layer
run per_layer_sp2 $SHAPE --per-layer --sp 2
