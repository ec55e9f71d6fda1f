#!/usr/bin/env bash
# Runs side by side on NGPUS GPUs, chosen to fill one 10-minute device call. Usage: [NGPUS=N] [GPUS=i,j,..]
# bash benchmarks/batches/gpu_batch.sh OUT [BATCH]. NGPUS defaults to the GPUs visible (nvidia-smi -L), GPUS to
# 0..NGPUS-1; "GPU k" below is the k-th of GPUS. Each BATCH names how many GPUs it needs (4 unless said) and is
# refused on fewer.
#   BATCH q17 (default; 2026-11-27's first call), runs side by side on disjoint GPUs:
#     GPU 0     fsdp_sp.sh q17_1gpu, then q17_fp32 (issue 37 (a) at the final code; float32 gradient parity)
#     GPU 1,2   fsdp_sp.sh q17_per_layer, then grad_bf16_check.py (cuda) and tests/test_shared_token_precision.py
#     GPU 3     trl_grpo_gpu.py (issue 34 (a)), TRL and datasets from carried wheels
#   BATCH profile, side by side (what 2026-11-27's second session left for the GPU):
#     GPU 0     peers.py --profile on the 30B-A3B MoE row (0.86 of the FLOP ideal) and the dense 8B row (0.93):
#               dualkv and plain_varlen under torch.profiler (kernels by kind, launches, host ops)
#     GPU 1, 2  compile_time.py, Llama-1B and Qwen3-1.7B shapes, cold and warm (each alone on its GPU)
#     GPU 3     the shared-token precision test (4,096 rows) and its breakdown per attention backend; the MoE row
#               at 4 and 16 rollouts (with 8 on GPU 0: whether dualkv's fixed part of the step is plain_varlen's)
#   BATCH compile, side by side: compile_time.py, one side per GPU (Llama-1B dualkv; Qwen3-1.7B plain; Qwen3-1.7B
#     dualkv), cold then warm, each within CT_S (default 500 s); GPU 3 the shared-token precision test and its
#     breakdown per backend at head dim 32 (the Triton kernels) and 8 (the reference backend), then the host time
#     of one attention call (op_overhead.py, cProfile of dualkv_gluon)
#   BATCH next, side by side, after `bash benchmarks/batches/fa4_wheels.sh install` in the same call (the wheels staged by the
#     call before): GPU 0 fa4_rows.sh (FA4's varlen attention alone; the 8K row with each kernel as the baseline's
#     kernel); GPUs 1-3 as BATCH compile (the warm starts after module_floats; Qwen3-1.7B plain's warm start, which
#     did not finish in 500 s; the precision test at the final code; the attention ops' host time)
#   BATCH warm, side by side (what 2026-11-27's last session left for the GPU): GPU 0 compile_time.py Llama-1B, both
#     sides, cold then warm, the warm first steps under cProfile and the caches kept: whether a warm start still
#     probes the CPU's instruction sets (cpu_vec_isa check_build, 47 s before module_floats baked every module float)
#     and which graphs hold C++ code (cpp_fused in the kept cache); GPU 1 Qwen3-1.7B plain's warm start (it did not
#     finish in 174 s); GPUs 2-3 the distributed example (FSDP2 per layer, --sp 2, bf16) at this code, then the GPU
#     tests of the files the session changed
#   BATCH warm2 (2 GPUs) (what 2026-11-28's first call left): GPU 0 Qwen3-1.7B plain's cold start, its cache kept
#     in /tmp/ck_q17 for BATCH warm2b (its cold start, 389 s, leaves too little of one call for its warm one); GPU 1
#     dualkv's cold and warm starts, Llama-1B then Qwen3-1.7B, the warm first steps under cProfile, Llama's cache kept
#     (whether it holds C++ code: cpp_fused)
#   BATCH warm2b (1 GPU), the next call on the same machine (within its idle release): Qwen3-1.7B plain's warm start
#   BATCH direct, side by side (runtime.direct_compile, not yet run on a GPU): GPUs 0-1 compile_time.py dualkv,
#     cold and warm, Llama-1B and Qwen3-1.7B (warm starts before it: 15.5 s and 54.1 s profiled); GPU 2 the dense
#     8B and MoE rows (peers.py, plain_varlen and dualkv: the step time must not move); GPU 3 the GPU tests of the
#     direct route, dynamic shapes and shared-token precision, then the nested route's Llama-1B compile times (A/B).
#     GPU 2's step times were NOT valid (benchmarks/results/compile_time/4xh100-2026-11-28-direct): a row must not share the host with
#     compiling processes (dualkv's step waits on the host's launches); time rows alone or beside other rows
#   BATCH final (2 GPUs): the distributed example (FSDP2 per layer, --sp 2, bf16), then dualkv's Llama-1B compile
#     times beside the GPU tests of the packed graph's compile
#   BATCH sp (2 or more GPUs), one after the other on all NGPUS: fsdp_sp.sh long_prompt (issue 37 (b), the 64K prompt
#     at sp NGPUS), then fsdp_sp.sh headline (issue 36, all 36 layers) with what is left of TOTAL_S (default 580 s)
# Each run compares its sides inside one process, so neighbours on other GPUs load both sides alike; the host's
# CPUs are shared. Everything goes into one archive beside OUT (the device tool brings back few files).
set -u
OUT=$1
BATCH=${2:-q17}
NGPUS=${NGPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
IFS=, read -r -a GPU <<< "${GPUS:-$(seq -s, 0 $((NGPUS - 1)))}"
need() {  # need N: BATCH runs on N GPUs
  if [ "$NGPUS" -lt "$1" ] 2>/dev/null || [ "${#GPU[@]}" -lt "$1" ]; then
    echo "gpu_batch.sh: BATCH $BATCH needs $1 GPUs, got NGPUS=$NGPUS (GPUS=${GPU[*]})" >&2
    exit 2
  fi
}
mkdir -p "$OUT"
export PYTHONPATH="$PWD"
start=$(date +%s)
case "$BATCH" in
  q17)
    need 4
    mkdir -p "$OUT/trl" "$OUT/grad" "$OUT/q17"
    ( CUDA_VISIBLE_DEVICES=${GPU[0]} LIMIT=270 bash benchmarks/distributed/fsdp_sp.sh "$OUT/q17" q17_1gpu
      CUDA_VISIBLE_DEVICES=${GPU[0]} bash benchmarks/distributed/fsdp_sp.sh "$OUT/q17" q17_fp32 ) > "$OUT/gpu0.txt" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=${GPU[1]},${GPU[2]} NGPUS=2 LIMIT=280 bash benchmarks/distributed/fsdp_sp.sh "$OUT/q17" q17_per_layer
      CUDA_VISIBLE_DEVICES=${GPU[1]} timeout 200 python3 benchmarks/probes/grad_bf16_check.py --device cuda --shape qwen3-0.6b --out "$OUT/grad"
      CUDA_VISIBLE_DEVICES=${GPU[2]} timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_shared_token_precision.py ) > "$OUT/gpu12.txt" 2>&1 &
    ( python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      CUDA_VISIBLE_DEVICES=${GPU[3]} PYTHONPATH=/tmp/site:$PWD timeout 540 python3 benchmarks/model/trl_grpo_gpu.py --out "$OUT/trl" ) > "$OUT/gpu3.txt" 2>&1 &
    wait
    tail -5 "$OUT/gpu0.txt" "$OUT/gpu12.txt" "$OUT/gpu3.txt" ;;
  profile)
    need 4
    mkdir -p "$OUT/prof30b" "$OUT/prof8b" "$OUT/ct_llama" "$OUT/ct_q17" "$OUT/moe_rollouts_4" "$OUT/moe_rollouts_16"
    PEERS="--device cuda --groups 2 --rollouts 8 --prompt-len 1024 --response-len 512 --ragged --compile --iters 5 --sides plain_varlen,dualkv --profile plain_varlen,dualkv"
    ( CUDA_VISIBLE_DEVICES=${GPU[0]} timeout 280 python3 benchmarks/peers/peers.py --shape qwen3-30b-a3b --layers 4 $PEERS --out "$OUT/prof30b"
      CUDA_VISIBLE_DEVICES=${GPU[0]} timeout 250 python3 benchmarks/peers/peers.py --shape qwen3-8b --layers 4 $PEERS --out "$OUT/prof8b" ) > "$OUT/gpu0.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=${GPU[1]} timeout 560 python3 benchmarks/compile/compile_time.py --model llama-1b --out "$OUT/ct_llama" > "$OUT/gpu1.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=${GPU[2]} timeout 560 python3 benchmarks/compile/compile_time.py --model 1.7b --out "$OUT/ct_q17" > "$OUT/gpu2.txt" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_shared_token_precision.py
      CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 150 python3 benchmarks/probes/shared_token_precision.py --rows 4096 --head-dim 32 --backends auto,triton,reference
      CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 150 python3 benchmarks/probes/shared_token_precision.py --rows 4096 --head-dim 8 --backends auto,reference
      for n in 4 16; do  # the MoE row at other group sizes: each side's time against its FLOPs, fixed part per side
        CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 120 python3 benchmarks/peers/peers.py --shape qwen3-30b-a3b --layers 4 ${PEERS/--rollouts 8/--rollouts $n} \
          --profile "" --out "$OUT/moe_rollouts_$n"
      done ) > "$OUT/gpu3.txt" 2>&1 &
    wait
    tail -n 8 "$OUT/gpu0.txt" "$OUT/gpu1.txt" "$OUT/gpu2.txt" "$OUT/gpu3.txt" ;;
  compile)
    need 4
    mkdir -p "$OUT/ct_llama_dualkv" "$OUT/ct_q17_plain" "$OUT/ct_q17_dualkv" "$OUT/prec"
    L=${CT_S:-500}
    CUDA_VISIBLE_DEVICES=${GPU[0]} timeout $L python3 benchmarks/compile/compile_time.py --model llama-1b --sides dualkv --out "$OUT/ct_llama_dualkv" > "$OUT/gpu0.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=${GPU[1]} timeout $L python3 benchmarks/compile/compile_time.py --model 1.7b --sides plain --out "$OUT/ct_q17_plain" > "$OUT/gpu1.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=${GPU[2]} timeout $L python3 benchmarks/compile/compile_time.py --model 1.7b --sides dualkv --out "$OUT/ct_q17_dualkv" > "$OUT/gpu2.txt" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_shared_token_precision.py
      CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 120 python3 benchmarks/probes/shared_token_precision.py --rows 4096 --head-dim 32 --backends auto,triton,reference
      CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 100 python3 benchmarks/probes/shared_token_precision.py --rows 4096 --head-dim 8 --backends auto,reference
      # the attention ops' host time per call (the MoE row's GPU waits on the host: benchmarks/results/peers/4xh200-2026-11-27-moe-profile)
      CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 120 python3 benchmarks/ops/op_overhead.py --methods sdpa_cudnn_dup,dualkv_gluon \
        --shapes 16,1024,512 --profile dualkv_gluon
    ) > "$OUT/gpu3.txt" 2>&1 &
    wait
    tail -n 8 "$OUT/gpu0.txt" "$OUT/gpu1.txt" "$OUT/gpu2.txt" "$OUT/gpu3.txt" ;;
  next)
    need 4
    mkdir -p "$OUT/ct_llama_dualkv" "$OUT/ct_q17_plain" "$OUT/ct_q17_dualkv"
    L=${CT_S:-560}
    ( export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
      CUDA_VISIBLE_DEVICES=${GPU[0]} bash benchmarks/batches/fa4_wheels.sh probe
      CUDA_VISIBLE_DEVICES=${GPU[0]} bash benchmarks/batches/fa4_rows.sh "$OUT/fa4" ) > "$OUT/gpu0.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=${GPU[1]} timeout $L python3 benchmarks/compile/compile_time.py --model 1.7b --sides plain --out "$OUT/ct_q17_plain" > "$OUT/gpu1.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=${GPU[2]} timeout $L python3 benchmarks/compile/compile_time.py --model 1.7b --sides dualkv --out "$OUT/ct_q17_dualkv" > "$OUT/gpu2.txt" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 330 python3 benchmarks/compile/compile_time.py --model llama-1b --sides dualkv --out "$OUT/ct_llama_dualkv"
      CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_shared_token_precision.py \
        tests/layout/test_host_twin.py
      CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 90 python3 benchmarks/ops/op_overhead.py --methods sdpa_cudnn_dup,dualkv_gluon \
        --shapes 16,1024,512 --profile dualkv_gluon ) > "$OUT/gpu3.txt" 2>&1 &
    wait
    tail -n 8 "$OUT/gpu0.txt" "$OUT/gpu1.txt" "$OUT/gpu2.txt" "$OUT/gpu3.txt"
    rm -f "$OUT/fa4.tgz" ;;
  warm)
    need 4
    mkdir -p "$OUT/ct_llama" "$OUT/ct_q17_plain" "$OUT/fsdp"
    ( CUDA_VISIBLE_DEVICES=${GPU[0]} timeout 570 python3 benchmarks/compile/compile_time.py --model llama-1b --profile-warm \
        --cache-dir /tmp/ck --out "$OUT/ct_llama"
      for side in plain dualkv; do echo "== $side: cached output code with C++ kernels"; grep -l cpp_fused -r "/tmp/ck/$side" \
        --include=*.py | head -5; done
      grep -h "check_build" "$OUT"/ct_llama/profile_*_warm.txt ) > "$OUT/gpu0.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=${GPU[1]} timeout 570 python3 benchmarks/compile/compile_time.py --model 1.7b --sides plain --profile-warm \
      --out "$OUT/ct_q17_plain" > "$OUT/gpu1.txt" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=${GPU[2]},${GPU[3]} timeout 300 torchrun --standalone --nproc-per-node 2 examples/fsdp_grpo.py --device cuda \
        --mode fsdp --bf16 --layers 4 --hidden 1024 --heads 16 --kv-heads 8 --vocab 32000 --prompts 2 --rollouts 8 \
        --prompt-len 1024 --response-len 256 --iters 3 --per-layer --sp 2
      CUDA_VISIBLE_DEVICES=${GPU[2]} timeout 200 python3 -m pytest -q -p no:cacheprovider tests/analysis/test_padding_reads.py \
        tests/layout/test_layout_syncs.py tests/layout/test_host_twin.py tests/rewrite/test_module_floats.py ) \
      > "$OUT/gpu23.txt" 2>&1 &
    wait
    tail -n 12 "$OUT/gpu0.txt" "$OUT/gpu1.txt" "$OUT/gpu23.txt" ;;
  warm2)
    need 2
    mkdir -p "$OUT/ct_q17_plain" "$OUT/ct_llama" "$OUT/ct_q17"
    CUDA_VISIBLE_DEVICES=${GPU[0]} timeout 570 python3 benchmarks/compile/compile_time.py --model 1.7b --sides plain --states cold \
      --cache-dir /tmp/ck_q17 --out "$OUT/ct_q17_plain" > "$OUT/gpu0.txt" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=${GPU[1]} timeout 200 python3 benchmarks/compile/compile_time.py --model llama-1b --sides dualkv \
        --profile-warm --cache-dir /tmp/ck_llama --out "$OUT/ct_llama"
      echo "== dualkv: cached output code with C++ kernels (none expected)"; grep -l cpp_fused -r /tmp/ck_llama --include=*.py | head -5
      CUDA_VISIBLE_DEVICES=${GPU[1]} timeout 360 python3 benchmarks/compile/compile_time.py --model 1.7b --sides dualkv --profile-warm \
        --out "$OUT/ct_q17" ) > "$OUT/gpu1.txt" 2>&1 &
    wait
    tail -n 12 "$OUT/gpu0.txt" "$OUT/gpu1.txt" ;;
  warm2b)
    need 1
    mkdir -p "$OUT/ct_q17_plain_warm"
    CUDA_VISIBLE_DEVICES=${GPU[0]} timeout 580 python3 benchmarks/compile/compile_time.py --model 1.7b --sides plain --states warm \
      --cache-dir /tmp/ck_q17 --profile-warm --out "$OUT/ct_q17_plain_warm" > "$OUT/gpu0.txt" 2>&1
    tail -n 12 "$OUT/gpu0.txt" ;;
  direct)
    need 4
    mkdir -p "$OUT/ct_llama" "$OUT/ct_q17" "$OUT/rows8b" "$OUT/rows30b"
    CUDA_VISIBLE_DEVICES=${GPU[0]} timeout 560 python3 benchmarks/compile/compile_time.py --model llama-1b --sides dualkv \
      --out "$OUT/ct_llama" > "$OUT/gpu0.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=${GPU[1]} timeout 560 python3 benchmarks/compile/compile_time.py --model 1.7b --sides dualkv \
      --out "$OUT/ct_q17" > "$OUT/gpu1.txt" 2>&1 &
    ROWS="--device cuda --groups 2 --rollouts 8 --prompt-len 1024 --response-len 512 --ragged --compile --iters 5 --sides plain_varlen,dualkv"
    ( CUDA_VISIBLE_DEVICES=${GPU[2]} timeout 270 python3 benchmarks/peers/peers.py --shape qwen3-8b --layers 4 $ROWS --out "$OUT/rows8b"
      CUDA_VISIBLE_DEVICES=${GPU[2]} timeout 270 python3 benchmarks/peers/peers.py --shape qwen3-30b-a3b --layers 4 $ROWS --out "$OUT/rows30b" ) \
      > "$OUT/gpu2.txt" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=${GPU[3]} timeout 300 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_direct_compile.py \
        tests/test_dynamic_shapes.py tests/test_shared_token_precision.py
      # the A/B: the nested route's Llama-1B cold and warm starts, beside GPU 0's direct ones (equally loaded host)
      mkdir -p "$OUT/ct_llama_nested"
      CUDA_VISIBLE_DEVICES=${GPU[3]} timeout $((555 - $(date +%s) + start)) python3 benchmarks/compile/compile_time.py --model llama-1b \
        --sides dualkv --packed-compile nested --out "$OUT/ct_llama_nested" ) > "$OUT/gpu3.txt" 2>&1 &
    wait
    tail -n 12 "$OUT/gpu0.txt" "$OUT/gpu1.txt" "$OUT/gpu2.txt" "$OUT/gpu3.txt" ;;
  final)
    need 2
    # On 2 GPUs, at the code a session submits: the distributed example (FSDP2 per layer, --sp 2, bf16), then side
    # by side dualkv's Llama-1B compile times (GPU 0) and the GPU tests of the packed graph's compile (GPU 1)
    mkdir -p "$OUT/ct_llama"
    CUDA_VISIBLE_DEVICES=${GPU[0]},${GPU[1]} timeout 240 torchrun --standalone --nproc-per-node 2 examples/fsdp_grpo.py --device cuda \
      --mode fsdp --bf16 --layers 4 --hidden 1024 --heads 16 --kv-heads 8 --vocab 32000 --prompts 2 --rollouts 8 \
      --prompt-len 1024 --response-len 256 --iters 3 --per-layer --sp 2 > "$OUT/fsdp.txt" 2>&1
    CUDA_VISIBLE_DEVICES=${GPU[0]} timeout $((570 - $(date +%s) + start)) python3 benchmarks/compile/compile_time.py --model llama-1b \
      --sides dualkv --out "$OUT/ct_llama" > "$OUT/gpu0.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=${GPU[1]} timeout $((570 - $(date +%s) + start)) python3 -m pytest -q -p no:cacheprovider \
      tests/runtime/test_direct_compile.py tests/test_dynamic_shapes.py tests/test_shared_token_precision.py \
      > "$OUT/gpu1.txt" 2>&1 &
    wait
    tail -n 12 "$OUT/fsdp.txt" "$OUT/gpu0.txt" "$OUT/gpu1.txt" ;;
  sp)
    need 2
    NGPUS=$NGPUS LIMIT=${SP4_S:-240} bash benchmarks/distributed/fsdp_sp.sh "$OUT" long_prompt
    left=$(( ${TOTAL_S:-580} - ($(date +%s) - start) ))
    echo "== long_prompt done after $(($(date +%s) - start)) s; headline gets ${left} s"
    NGPUS=$NGPUS LIMIT=$left bash benchmarks/distributed/fsdp_sp.sh "$OUT" headline ;;
  *) echo "gpu_batch.sh: unknown BATCH '$BATCH' (q17, profile, compile, next, warm, warm2, warm2b, direct, final or sp)" >&2; exit 2 ;;
esac
echo "== batch $BATCH done after $(($(date +%s) - start)) s"
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
