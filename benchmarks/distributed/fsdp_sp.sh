#!/usr/bin/env bash
# examples/fsdp_grpo.py on NGPUS GPUs (NCCL): FSDP2 on the root, per layer, and sequence parallelism over the NGPUS
# ranks (--sp NGPUS), each against the plain step on the same shape. Usage: NGPUS=N bash benchmarks/distributed/fsdp_sp.sh
# OUTDIR [SET]; NGPUS defaults to the GPUs visible (nvidia-smi -L), a run on fewer than 2 is refused where a set needs 2.
#   SET small      (default) the shape: 4 layers, hidden 1024, 2 x 8 rollouts, 1K prompts, 256 responses;
#                  root, per layer, --sp NGPUS, per layer with --sp NGPUS
#   SET profile    the small shape on the root, 1 and NGPUS GPUs, with --profile (torch.profiler tables)
#   SET realistic  a Qwen3-1.7B-wide shape (hidden 2048, 16 / 8 heads, 4 layers, vocab 32000), 2 x 8 rollouts,
#                  4K prompts, 1K responses per rank: 1 GPU, NGPUS GPUs on the root, per layer, --sp NGPUS
#   SET qwen3_1p7b the whole Qwen3-1.7B shape (28 layers, MLP 6144, vocab 151936; untied head), 2 x 8 rollouts,
#                  4K prompts, 1K responses per rank, FSDP2 per layer, activation checkpointing, log-probs in the
#                  model, against the remove-padding baseline (--baseline ulysses at sp 1): 1 GPU, then NGPUS GPUs
#   SET long_prompt  the Qwen3-8B width at 4 layers, a 64K prompt + 8 x 2K responses, --sp NGPUS on NGPUS GPUs against
#                  Ulysses on the duplicated remove-padding batch at sp NGPUS (sp4: the same with NGPUS=4)
#   SET headline   the DualKV paper's headline shape: Qwen3-8B (36 layers, hidden 4096, MLP 12288, 32 / 8 heads,
#                  vocab 151936), one prompt x N = 32 rollouts, 8K context (a 4K prompt and 4K responses, fixed lengths),
#                  FSDP2 per layer, activation checkpointing, log-probs in the model, --sp NGPUS, against Ulysses on the
#                  duplicated remove-padding batch at sp NGPUS; fsdp_grpo.md gives the MFU both ways (logical, executed);
#                  LAYERS=N runs N of the 36 layers (all 36 ran out of memory on both sides at sp 4 on 80 GB cards)
#   SET small_shared  the small shape per layer and on the root (dualkv wrapped in shared_batch, the default)
#   SET q17_fp32   gradient parity at the Qwen3-1.7B depth in float32 (28 layers, 1 GPU, 1 x 8 rollouts of 2K + 512,
#                  tolerance 1e-4): whether the bf16 runs' 5e-2 gradient differences are rounding
#   SET q17_1gpu, q17_per_layer  one half each of qwen3_1p7b (torchrun --standalone: several sets can run at once on
#                  disjoint CUDA_VISIBLE_DEVICES)
# Logs and each run's fsdp_grpo.md/json (and profile tables) go under OUTDIR; each log's last lines are printed.
set -u
OUT=${1:-fsdp_sp_runs}
SET=${2:-small}
if [ "$SET" = sp4 ]; then SET=long_prompt NGPUS=${NGPUS:-4}; fi  # the set's name before it took NGPUS
NGPUS=${NGPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
case "$SET" in q17_1gpu|q17_fp32) ;; *)
  [ "$NGPUS" -ge 2 ] 2>/dev/null || { echo "fsdp_sp.sh: SET $SET needs NGPUS >= 2 GPUs, got '$NGPUS'" >&2; exit 2; } ;;
esac
N=$NGPUS
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout (not installed there)
SMALL="--device cuda --mode fsdp --bf16 --layers 4 --hidden 1024 --heads 16 --kv-heads 8 --vocab 32000 --prompts 2 --rollouts 8 --prompt-len 1024 --response-len 256 --iters 5"
Q17="--device cuda --mode fsdp --bf16 --per-layer --checkpoint --logprobs-in-model --baseline ulysses --layers 28 --hidden 2048 --intermediate 6144 --heads 16 --kv-heads 8 --vocab 151936 --prompts 2 --rollouts 8 --prompt-len 4096 --response-len 1024 --iters 3"
W8B="--device cuda --mode fsdp --bf16 --baseline ulysses --fixed-lengths --checkpoint --logprobs-in-model --layers 4 --hidden 4096 --intermediate 12288 --heads 32 --kv-heads 8 --vocab 151936 --prompts 1 --rollouts 8 --prompt-len 65536 --response-len 2048 --iters 2"
HEADLINE="--device cuda --mode fsdp --bf16 --per-layer --checkpoint --logprobs-in-model --baseline ulysses --fixed-lengths --layers ${LAYERS:-36} --hidden 4096 --intermediate 12288 --heads 32 --kv-heads 8 --vocab 151936 --prompts 1 --rollouts 32 --prompt-len 4096 --response-len 4096 --iters 2"
REAL="--device cuda --mode fsdp --bf16 --layers 4 --hidden 2048 --heads 16 --kv-heads 8 --vocab 32000 --prompts 2 --rollouts 8 --prompt-len 4096 --response-len 1024 --iters 3"
run() {
  name=$1; gpus=$2; shift 2
  echo "=== $name ($gpus GPU): $*" | tee "$OUT/$name.log"
  PYTHONUNBUFFERED=1 timeout -k 15 ${LIMIT:-170} torchrun --standalone --nproc-per-node "$gpus" examples/fsdp_grpo.py "$@" --out "$OUT/$name" >>"$OUT/$name.log" 2>&1
  echo "exit $?" >>"$OUT/$name.log"
  grep -E "fsdp_grpo:|Error|error:" "$OUT/$name.log" | grep -v Warning | tail -3
}
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count())"
case "$SET" in
  small)
    run sp$N $N $SMALL --sp $N
    run root $N $SMALL
    run per_layer $N $SMALL --per-layer
    run per_layer_sp$N $N $SMALL --per-layer --sp $N ;;
  profile)
    run profile_1gpu 1 $SMALL --profile
    run profile_root $N $SMALL --profile ;;
  realistic)
    run real_1gpu 1 $REAL
    run real_root $N $REAL
    run real_per_layer $N $REAL --per-layer
    run real_sp$N $N $REAL --sp $N ;;
  qwen3_1p7b)
    LIMIT=280 run q17_1gpu 1 $Q17
    LIMIT=280 run q17_per_layer $N $Q17 ;;
  q17_1gpu)  # one half of qwen3_1p7b, to run beside other work on a larger machine (CUDA_VISIBLE_DEVICES)
    LIMIT=${LIMIT:-280} run q17_1gpu 1 $Q17 ;;
  q17_per_layer)
    LIMIT=${LIMIT:-280} run q17_per_layer $N $Q17 ;;
  long_prompt)
    LIMIT=${LIMIT:-560} run w8b_sp$N $N $W8B --sp $N ;;
  headline)
    LIMIT=${LIMIT:-570} run headline_sp${N}_${LAYERS:-36}l $N $HEADLINE --sp $N ;;
  q17_fp32)
    LIMIT=280 run q17_fp32 1 --device cuda --mode fsdp --per-layer --checkpoint --logprobs-in-model --baseline ulysses \
      --layers 28 --hidden 2048 --intermediate 6144 --heads 16 --kv-heads 8 --vocab 151936 --prompts 1 --rollouts 8 \
      --prompt-len 2048 --response-len 512 --iters 1 ;;
  small_shared)
    run small_per_layer $N $SMALL --per-layer
    run small_root $N $SMALL ;;
  *) echo "fsdp_sp.sh: unknown SET '$SET' (small, profile, realistic, qwen3_1p7b, q17_1gpu, q17_per_layer, long_prompt," \
       "headline, q17_fp32 or small_shared)" >&2; exit 2 ;;
esac
