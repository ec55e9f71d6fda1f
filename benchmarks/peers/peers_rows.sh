#!/usr/bin/env bash
# Issue 36's rows of peers.py on NGPUS GPUs: each row one process under `timeout`, into OUT/<row>/ (peers.json and
# peers.md are rewritten after every side, so a row cut short keeps the sides it measured); a row that fails or
# times out does not stop the next. At the end, every row's markdown.
#
#   bash benchmarks/peers/peers_rows.sh OUT [ROW ...]          ROW of: 8b 30b-a3b 0.6b 1.7b (default: all, in that order)
#   NGPUS=4 bash benchmarks/peers/peers_rows.sh OUT            the rows side by side, row i on GPU i mod NGPUS
#
# The batch of every row: 2 prompts x 8 rollouts, 1024-token prompts, responses of 256..512 tokens (--ragged),
# --compile (plain_compiled, and plain_varlen under Inductor: the strongest baseline), --iters 5, bf16.
# The 4-layer rows come first: they compile in far less time than the 28-layer ones, so a call cut short still
# collects the most rows. Env: NGPUS (default 1): the GPUs to spread the rows over (CUDA_VISIBLE_DEVICES=i mod NGPUS
# for the i-th row; each GPU runs its rows one after the other); BUDGET_S (default 570: the whole run, per GPU),
# ROW_S (most seconds one row may take, default 300; a row gets the smaller of that and what is left of its GPU's
# budget), PYTHON (python3).
#
# Memory (80 GB cards), the 30B-A3B shape with 4 of 48 layers: 3.1e9 parameters (embedding and lm_head 2 x 0.31e9;
# per layer 128 experts x 3 x 2048 x 768 = 0.60e9 plus attention 0.02e9), bf16 weights 6.2 GB + gradients 6.2 GB.
# The batch is 16 x 1536 = 24,576 padded tokens; the plain eager side's logits are 7.5 GB in bf16 and 15 GB per
# float32 copy (log_softmax's output kept, its gradient, the cast back: about 45 GB at lm_head's backward), the 4
# layers' activations with 8 active experts about 8 GB: about 65 GB, so the full batch (responses up to 512) is
# kept. model_moe.py measured 45.5 GB for Inductor on 22,207 tokens of this shape (H200). The 1.7B row's plain
# eager side (28 layers, ~2.3 MB of activations a token, ~56 GB, plus the same logits) likely runs out of memory:
# its row then says `cannot run: OutOfMemoryError`, and the first plain side that ran is the exactness reference
# (the report names it); the speedups are against plain_varlen either way.
set -u
OUT=${1:?usage: bash benchmarks/peers/peers_rows.sh OUT [ROW ...]}
shift
ROWS=${*:-8b 30b-a3b 0.6b 1.7b}
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-570}
ROW_S=${ROW_S:-300}
BATCH="--device cuda --groups 2 --rollouts 8 --prompt-len 1024 --response-len 512 --ragged --compile --iters 5"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

flags() {  # the shape flags of a row
  case $1 in
    0.6b) echo "--shape qwen3-0.6b" ;;
    1.7b) echo "--shape qwen3-1.7b" ;;
    8b) echo "--shape qwen3-8b --layers 4" ;;
    30b-a3b) echo "--shape qwen3-30b-a3b --layers 4" ;;
    *) echo "peers_rows.sh: unknown row '$1' (ROW of: 8b 30b-a3b 0.6b 1.7b)" >&2; return 1 ;;
  esac
}

for row in $ROWS; do flags "$row" > /dev/null || exit 2; done

NGPUS=${NGPUS:-1}
[ "$NGPUS" -ge 1 ] 2>/dev/null || { echo "peers_rows.sh: NGPUS: expected a count of GPUs >= 1, got '$NGPUS'" >&2; exit 2; }

run_rows() {  # run_rows GPU ROW...: the rows one after the other on one GPU, within BUDGET_S
  local gpu=$1 row cmd left limit rc
  shift
  for row in "$@"; do
    mkdir -p "$OUT/$row"
    cmd="$PYTHON benchmarks/peers/peers.py $(flags "$row") $BATCH --out $OUT/$row"
    left=$((BUDGET_S - ($(date +%s) - start)))
    limit=$((left < ROW_S ? left : ROW_S))
    if [ "$limit" -lt 60 ]; then
      echo "== $row: skipped, ${left}s of the budget left" | tee "$OUT/$row/log.txt"
      continue
    fi
    echo "== $row on GPU $gpu (timeout ${limit}s): $cmd"
    CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 "$limit" $cmd > "$OUT/$row/log.txt" 2>&1
    rc=$?
    echo "== $row: exit $rc$([ $rc = 124 ] && echo ' (timed out)'), $(($(date +%s) - start))s since the start"
    tail -3 "$OUT/$row/log.txt"
  done
}

i=0
declare -a ON_GPU
for row in $ROWS; do
  ON_GPU[$((i % NGPUS))]+="$row "
  i=$((i + 1))
done
for gpu in "${!ON_GPU[@]}"; do
  if [ "$NGPUS" = 1 ]; then run_rows "$gpu" ${ON_GPU[$gpu]}; else run_rows "$gpu" ${ON_GPU[$gpu]} & fi
done
wait

for row in $ROWS; do
  echo
  if [ -f "$OUT/$row/peers.md" ]; then cat "$OUT/$row/peers.md"; else echo "## $row: no result"; tail -5 "$OUT/$row/log.txt"; fi
done
