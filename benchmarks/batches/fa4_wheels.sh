#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, CuTe DSL) for GPU machines that install nothing from the network and take at most
# CARRY_MB per call. Its wheels are about 100 MB; a wheel over CARRY_MB (nvidia-cutlass-dsl-libs-cu13, 92 MB, over a
# 64 MiB limit) travels in two halves over two calls made back to back (/tmp surviving between them).
#
#   here:   bash benchmarks/batches/fa4_wheels.sh fetch       # -> .whl-fa4/a (the small wheels + first halves),
#                                                             #    .whl-fa4/b (second halves)
#   call 1: carry [".whl-fa4/a"], command: bash benchmarks/batches/fa4_wheels.sh stage
#   call 2: carry [".whl-fa4/b"], command: bash benchmarks/batches/fa4_wheels.sh install &&
#           export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD
#           (then the same call can run what needs FA4; `probe` checks that it runs on this GPU)
# Env: PY_VERSION (the GPU machine's Python, default 3.12), CU (its CUDA major, default 13: the cutlass-dsl libs built
# for it), CARRY_MB (default 64), SITE (the install folder, default /tmp/site). The machines' image is assumed to hold
# torch, einops, cuda-bindings, protobuf and typing-extensions: they are not carried.
set -eu
V=4.0.0b36 CUTLASS=4.8.1
PY_VERSION=${PY_VERSION:-3.12} CU=${CU:-13} CARRY_MB=${CARRY_MB:-64} SITE=${SITE:-/tmp/site}
case "${1:?fetch, stage, install or probe}" in
  fetch)
    grep -qx '/.whl-fa4/' .git/info/exclude || echo /.whl-fa4/ >> .git/info/exclude
    rm -rf .whl-fa4 /tmp/fa4-dl && mkdir -p .whl-fa4/a .whl-fa4/b /tmp/fa4-dl
    P="--no-deps --pre --only-binary=:all: --python-version $PY_VERSION --implementation cp -d /tmp/fa4-dl"
    for n in 17 24 27 28 34; do P="$P --platform manylinux_2_${n}_x86_64"; done
    for w in "flash-attn-4==$V" "nvidia-cutlass-dsl==$CUTLASS" "nvidia-cutlass-dsl-libs-base==$CUTLASS" \
             "nvidia-cutlass-dsl-libs-core==$CUTLASS" "nvidia-cutlass-dsl-libs-cu$CU==$CUTLASS" apache-tvm-ffi \
             torch-c-dlpack-ext quack-kernels; do
      python3 -m pip download $P --platform manylinux2014_x86_64 "$w" >/dev/null
    done
    : > .whl-fa4/a/split.names
    for whl in /tmp/fa4-dl/*.whl; do
      name=$(basename "$whl")
      if [ "$(stat -c %s "$whl")" -gt $((CARRY_MB * 1024 * 1024 * 9 / 10)) ]; then  # over 90% of a call's carry
        split -n 2 -d "$whl" "/tmp/fa4-dl/$name.part"
        mv "/tmp/fa4-dl/$name.part00" .whl-fa4/a/ && mv "/tmp/fa4-dl/$name.part01" .whl-fa4/b/
        echo "$name" >> .whl-fa4/a/split.names
      else
        cp "$whl" .whl-fa4/a/
      fi
    done
    du -sh .whl-fa4/a .whl-fa4/b ;;
  stage)
    mkdir -p /tmp/fa4 && cp .whl-fa4/a/* /tmp/fa4/ && ls /tmp/fa4 ;;
  install)
    while read -r name; do
      cat "/tmp/fa4/$name.part00" ".whl-fa4/b/$name.part01" > "/tmp/fa4/$name"
    done < /tmp/fa4/split.names
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" /tmp/fa4/*.whl
    # nvidia-cutlass-dsl puts its `cutlass` package on sys.path through a .pth file, which a --target folder on
    # PYTHONPATH never runs (a GPU run of the probe failed on "No module named 'cutlass'"): name the folder itself.
    echo "flash-attn-4 $V installed under $SITE; use PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages" ;;
  probe)  # a varlen forward and backward on this GPU, against SDPA per sequence
    python3 - <<'PY'
import torch
from flash_attn.cute import flash_attn_varlen_func
torch.manual_seed(0)
lens = [700, 300]
cu = torch.tensor([0, 700, 1000], dtype=torch.int32, device="cuda")
q, k, v = (torch.randn(1000, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (16, 8, 8))
out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=700, max_seqlen_k=700, causal=True)
out = out[0] if isinstance(out, tuple) else out
out.float().square().sum().backward()
ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
    q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None], is_causal=True,
    enable_gqa=True)[0].transpose(0, 1) for a, b in ((0, 700), (700, 1000))])
print(torch.cuda.get_device_name(), "FA4 varlen fwd+bwd ran; max |out - sdpa|", (out - ref).abs().max().item())
PY
    ;;
  *) echo "fa4_wheels.sh: expected fetch, stage, install or probe, got '$1'" >&2; exit 2 ;;
esac
