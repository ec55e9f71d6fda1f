#!/usr/bin/env bash
# The Gluon kernels' head dim 64 launch configs on one sm_90 GPU (ARCH, default the GPU's compute capability; the
# Gluon kernels run on 9.0 only), under 10 minutes: issue 36 asked for it where the D=64 tiles, tuned on another
# sm_90 card, left two rows of benchmarks/ops/attention.py at 0.931 and 0.914 of cuDNN's fwd+bwd efficiency:
#   1. sweep the D=64 launch configs of the three kernels (benchmarks/tuning/gluon_tune.py --json; each list starts
#      with the table's default, so the picker can tell whether anything beats it);      dkdv 135 s, dq 105 s, fwd 75 s
#   2. pick per kernel the fastest config within 1e-2 of the Triton result, by the geometric mean over the sweep's
#      inputs (benchmarks/tuning/gluon_pick.py; a kernel whose default wins is left out);              under 1 s, no torch
#   3. the attention rows at D=64 with the defaults (before), then with the picked configs (after,
#      attention.py --gluon-configs; skipped when nothing beat the defaults), the same three shapes;    100 s + 100 s
#   4. a before/after table of dualkv_gluon's "vs cuDNN" (gluon_pick.py --compare, compare.md), and the tar of OUT.
# Each step runs under its own timeout (+5 s to a KILL), so a step that hangs or times out costs its limit and
# the rest still run: at most 515 + 25 s of steps, then the tar. A sweep cut short keeps in its JSON the inputs
# it finished; the picker uses those. steps.txt lists each step's exit status and seconds (124: timed out).
# Usage: [ARCH=9.0] [PYTHON=python3] bash benchmarks/tuning/gluon_d64.sh OUT    (OUT.tgz: everything)
set -u
OUT=${1:?usage: bash benchmarks/tuning/gluon_d64.sh OUT}
ARCH=${ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)}
if [ "$ARCH" != 9.0 ]; then
  echo "gluon_d64.sh: the Gluon kernels need an sm_90 GPU (ARCH 9.0), this one is '${ARCH:-none}'" >&2
  exit 2
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-${D64_PYTHON:-python3}}  # the interpreter

step() {  # step NAME LIMIT_S CMD...: CMD under a timeout, its output in OUT/NAME.txt, its status in OUT/steps.txt
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
}

nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
# D=64 (Hq 16 / Hkv 4 in the sweep). Each list starts with the default. Every config below compiles for sm_90 with
# triton 3.6 without spills in its loops (sm90_resources.py's compile-only driver, on a CPU): 128-row dK/dV steps
# and 128-key dQ blocks spill there (102 and 116 LDL/STL), so they are not swept; nor 64-key dK/dV programs (32 keys
# per warpgroup, under the wgmma's 64 rows). Compiles take 2-4 s each; the time goes to do_bench (~0.4 s a point).
# dK/dV: 128-key programs, 64-row steps, 2 stages is the default (2 and 3 equal on the H200 at D=128; D=64 halves
# the tiles, so deeper rings fit: 66-118 KB of shared memory).
step dkdv 135 "$PY" benchmarks/tuning/gluon_tune.py dkdv --head-dim 64 --json "$OUT/dkdv.json" \
  "block_n=128, block_m=64, stages=2; block_n=128, block_m=64, stages=3; block_n=128, block_m=64, stages=4; block_n=128, block_m=64, stages=5; block_n=128, block_m=32, stages=4; block_n=128, block_m=32, stages=6"
# dQ: 64-key blocks, 4 stages is the default (3 stages within 3% on the H200 at D=64; 32-key blocks 6% slower at D=128).
step dq 105 "$PY" benchmarks/tuning/gluon_tune.py dq --head-dim 64 --json "$OUT/dq.json" \
  "block_m=128, block_n=64, stages=4; block_m=128, block_n=64, stages=3; block_m=128, block_n=64, stages=2; block_m=128, block_n=64, stages=5; block_m=128, block_n=32, stages=4; block_m=128, block_n=32, stages=6"
# Forward: 128-key blocks, 2 stages is the default; 3 stages, with or without ping-pong, were within 6% on the H200 at
# D=64 (64-key blocks 22% slower: not swept).
step fwd 75 "$PY" benchmarks/tuning/gluon_tune.py fwd --head-dim 64 --json "$OUT/fwd.json" \
  "block_m=128, block_n=128, stages=2; block_m=128, block_n=128, stages=3; block_m=128, block_n=128, stages=4; block_m=128, block_n=128, stages=3, pingpong=True; block_m=128, block_n=128, stages=2, pingpong=True"

"$PY" benchmarks/tuning/gluon_pick.py "$OUT/fwd.json" "$OUT/dq.json" "$OUT/dkdv.json" > "$OUT/picked.txt" 2> "$OUT/pick.txt"
PICK=$(cat "$OUT/picked.txt")
cat "$OUT/pick.txt"
echo "picked: ${PICK:-nothing (the defaults stay)}"

ATT=(benchmarks/ops/attention.py --head-dim 64 --skip-mask --methods sdpa_cudnn_dup,dualkv_gluon
     --shapes 16,4096,1024 --shapes 28,4096,2048 --shapes 28,16384,1024 --out "$OUT")
step before 100 "$PY" "${ATT[@]}" --stem attention_d64_defaults
if [ -n "$PICK" ]; then
  step after 100 "$PY" "${ATT[@]}" --stem attention_d64_tuned --gluon-configs "$PICK"
  "$PY" benchmarks/tuning/gluon_pick.py --compare "$OUT/attention_d64_defaults.json" "$OUT/attention_d64_tuned.json" \
    2>&1 | tee "$OUT/compare.md"
else
  echo "after: skipped (no config beat the defaults)" | tee -a "$OUT/steps.txt"
  grep -i "^## \|dualkv_gluon" "$OUT/attention_d64_defaults.md" | head -12
fi
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
