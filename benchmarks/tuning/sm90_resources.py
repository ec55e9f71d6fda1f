"""Compile the shared-prompt attention kernels for Hopper (sm_90) on a machine without a GPU.

    python benchmarks/tuning/sm90_resources.py                       # the Hopper table, D=128
    python benchmarks/tuning/sm90_resources.py --head-dim 64
    python benchmarks/tuning/sm90_resources.py --gluon               # the warp-specialised Gluon kernels
    python benchmarks/tuning/sm90_resources.py --config "Config(KC(128, 128, 8, 3, tma=True), \\
        KC(32, 64, 4, 3, tma=True, stats_tma=True), KC(128, 64, 8, 3))"

For each kernel of one forward and one backward it prints what the compiler
decided, with no device time spent: registers per thread, local-memory stack
(spills), shared memory, how many programs fit on one SM, and for each inner
loop of the SASS its length and its counts of matrix instructions (HGMMA),
their waits (DEPBAR), spill loads and stores (LDL/STL), copy-engine and
pointer copies (UTMALDG/LDGSTS) and exponentials; and whether it was compiled
with floating-point contraction (FMAs: ``kernels/triton/launch.py``). Spills inside a loop, or a
wait after every HGMMA, predict a slow kernel before it is ever timed
(benchmarks/results/triton_tune/h200-2026-11-22/triton_tuning.md, run 5).

How: Triton's active driver is replaced by one that reports an sm_90 target,
and every kernel launch becomes a compile-only warm-up; the cubin is read
back with the ``cuobjdump`` that ships in Triton's NVIDIA backend. Use the
Triton version the GPU machine has (a side venv with ``pip install
triton==3.6.0`` for the H200 here): code generation differs between versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# The kernels must compile, not run under the interpreter (which triton.jit reads at import).
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SASS_OPS = {"HGMMA": r"\bHGMMA", "DEPBAR": r"DEPBAR", "LDL": r"\bLDL", "STL": r"\bSTL", "LDGSTS": r"LDGSTS",
            "UTMALDG": r"UTMALDG", "EX2": r"MUFU\.EX2"}
REGISTERS_PER_SM, SHARED_PER_SM = 65536, 232448


class _Sm90Driver:
    """Just enough of a driver for Triton to compile for sm_90 and stop before loading."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def map_python_to_cpp_type(self, t):
        return t


def _compile_only(compiled: list):
    """Make every launch a warm-up (compile, never run) and keep what it compiled."""
    run = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = warm


def inner_loops(sass: str) -> list[dict]:
    """Instruction counts of each innermost loop (a backward branch enclosing no other)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    out = []
    for a, b in inner:
        body = [t for addr, t in ins if a <= addr <= b]
        counts = {k: sum(1 for t in body if re.search(p, t)) for k, p in SASS_OPS.items()}
        out.append(dict(instructions=len(body), **{k: v for k, v in counts.items() if v}))
    return [loop for loop in out if loop["instructions"] > 50]  # not the copy engine's wait spins


def resources(name: str, kernel) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(CUOBJDUMP), "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    setmaxnreg = len(re.findall(r"USETMAXREG", sass))  # register reallocation between warp-specialised partitions
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    smem, warps = kernel.metadata.shared, kernel.metadata.num_warps
    per_sm = min(REGISTERS_PER_SM // (regs * 32 * warps), SHARED_PER_SM // max(smem, 1))
    return dict(kernel=name, registers=regs, stack_bytes=stack, shared_kb=round(smem / 1024, 1), warps=warps,
                stages=kernel.metadata.num_stages, programs_per_sm=per_sm, setmaxnreg=setmaxnreg,
                fp_fusion=kernel.metadata.enable_fp_fusion, loops=inner_loops(sass))


def compile_kernels(config, head_dim: int = 128, q_heads: int = 32, kv_heads: int = 8, tokens: int = 4096) -> list:
    """Compile one forward and one backward of ``config`` for sm_90; the resource record of each kernel."""
    from dualkv_compile.kernels.triton import attention as ta, tma
    from dualkv_compile.layout import tree_segments

    compiled: list = []
    driver.set_active(_Sm90Driver())
    _compile_only(compiled)
    # Compile for the GPU although the tensors live on the CPU: the GPU's dot flags, no checks of
    # the (absent) device, descriptors allowed.
    ta._dot_flags = lambda q: dict(DOT_PREC="tf32", UPCAST=False)
    ta._check = lambda *a: None
    tma.interpreting = lambda: True
    torch.cuda.get_device_capability = lambda *a: (9, 0)

    P, R = tokens // 2, tokens // 4
    segs = tree_segments([P, R, R], [-1, 0, 0])
    make = lambda h: torch.randn(1, h, tokens, head_dim).bfloat16()  # noqa: E731
    q, k, v, do = make(q_heads), make(kv_heads), make(kv_heads), make(q_heads)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # as a projection lays it out
    scale = 1 / math.sqrt(head_dim)
    out, lse = torch.empty_like(q), torch.empty(1, q_heads, tokens)
    ta.forward(q, k, v, segs, scale, config=config)
    ta.backward(do, q, k, v, out, lse, segs, scale, False, config=config)
    return [resources(name, kernel) for name, kernel in compiled if kernel is not None]


def compile_gluon_kernels(head_dim: int = 128, q_heads: int = 32, kv_heads: int = 8, tokens: int = 4096) -> list:
    """Compile the Gluon forward, dK/dV and dQ kernels (``kernels/gluon``, with the Triton preprocess kernel
    they share) for sm_90; the resource record of each. The dK/dV kernel twice: recomputing dQ in the dQ
    kernel, then adding it itself (``DkdvConfig(dq_mode="atomic")``, head dim 128; "auto" picks one)."""
    from dualkv_compile.kernels.gluon import attention as ga
    from dualkv_compile.kernels.triton import attention as ta
    from dualkv_compile.layout import tree_segments

    compiled: list = []
    driver.set_active(_Sm90Driver())
    _compile_only(compiled)
    ga.supports = lambda *a: None
    ta._check = lambda *a: None
    P, R = tokens // 2, tokens // 4
    segs = tree_segments([P, R, R], [-1, 0, 0])
    make = lambda h: torch.randn(1, tokens, h, head_dim).bfloat16().transpose(1, 2)  # noqa: E731  token-major
    q, k, v, do = make(q_heads), make(kv_heads), make(kv_heads), make(q_heads)
    scale = 1 / math.sqrt(head_dim)
    ga.forward(q, k, v, segs, scale)
    for dq_mode in ("recompute", "atomic"):  # the head dim's default tiles (DKDV_CONFIGS), each dQ mode
        ga.backward(do, q, k, v, q, torch.zeros(1, q_heads, tokens), segs, scale,
                    dkdv_config=dataclasses.replace(ga.DKDV_CONFIGS[head_dim], dq_mode=dq_mode))
    return [resources(name, kernel) for name, kernel in compiled if kernel is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--config", default=None, help="a Config(...) expression (KC = KernelConfig); default: the table")
    ap.add_argument("--gluon", action="store_true", help="the Gluon kernels instead of the Triton kernels")
    args = ap.parse_args()
    from dualkv_compile.kernels.triton.attention import HOPPER_CONFIGS, Config, KernelConfig

    cfg = (eval(args.config, {"Config": Config, "KernelConfig": KernelConfig, "KC": KernelConfig}) if args.config
           else HOPPER_CONFIGS[max(64, 1 << (args.head_dim - 1).bit_length())])
    if args.gluon:
        from dualkv_compile.kernels.gluon.attention import DKDV_CONFIGS, DQ_CONFIGS, FWD_CONFIGS

        print(f"triton {triton.__version__}, sm_90, D={args.head_dim}: Gluon forward {FWD_CONFIGS[args.head_dim]}, "
              f"dK/dV {DKDV_CONFIGS[args.head_dim]}, dQ {DQ_CONFIGS[args.head_dim]}")
        records = compile_gluon_kernels(args.head_dim)
    else:
        print(f"triton {triton.__version__}, sm_90, D={args.head_dim}: {cfg}")
        records = compile_kernels(cfg, args.head_dim)
    for r in records:
        print(f"{r['kernel']:26s} {r['registers']:3d} registers, {r['stack_bytes']:5d} B stack, "
              f"{r['shared_kb']:6.1f} KB shared, {r['warps']} warps, {r['programs_per_sm']} per SM, "
              f"{r['setmaxnreg']} setmaxnreg, FMA contraction {'on' if r['fp_fusion'] else 'off'}")
        for loop in r["loops"]:
            print(f"    loop {loop}")


if __name__ == "__main__":
    main()
