"""What Gluon (``triton.experimental.gluon``) offers in the installed triton, and a smoke kernel that runs.

Issue 20 (an FA3-class Hopper kernel) asks for this check before planning: the modules and entry points a
warp-specialised attention kernel needs (TMA descriptors and copies, mbarriers, async wgmma, warp_specialize,
the NVMMA layouts), printed with their signatures, then a one-line Gluon kernel compiled and run on the GPU.

    python benchmarks/probes/gluon_probe.py      # on a CUDA machine; results/gluon_probe/h200-2026-11-25/gluon_probe_h200.md has the H200's answer
"""
import importlib, inspect, sys, torch, triton
print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
print("gl:", sorted(n for n in dir(gl) if not n.startswith("_")))
for mod in ["triton.experimental.gluon.language.nvidia.hopper", "triton.experimental.gluon.language.nvidia.hopper.tma",
            "triton.experimental.gluon.language.nvidia.hopper.mbarrier", "triton.experimental.gluon.language.nvidia.ampere",
            "triton.experimental.gluon.language.nvidia.ampere.async_copy", "triton.experimental.gluon.nvidia.hopper",
            "triton.experimental.gluon.language.nvidia.blackwell"]:
    try:
        m = importlib.import_module(mod)
        print(mod, ":", sorted(n for n in dir(m) if not n.startswith("_")))
    except Exception as e:
        print(mod, ": MISSING", type(e).__name__, e)
for name in ["warp_specialize", "NVMMASharedLayout", "NVMMADistributedLayout", "BlockedLayout", "SliceLayout", "DotOperandLayout", "allocate_shared_memory", "convert_layout"]:
    obj = getattr(gl, name, None)
    print(name, "->", None if obj is None else (str(inspect.signature(obj)) if callable(obj) else obj))
try:
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait
    print("warpgroup_mma", inspect.signature(warpgroup_mma), "| wait", inspect.signature(warpgroup_mma_wait))
    from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier
    print("tma:", [n for n in dir(tma) if not n.startswith("_")]); print("mbarrier:", [n for n in dir(mbarrier) if not n.startswith("_")])
    print("async_copy_global_to_shared", inspect.signature(tma.async_copy_global_to_shared))
except Exception as e:
    print("hopper api:", type(e).__name__, e)


@gluon.jit
def copy_kernel(in_ptr, out_ptr, n, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    mask = offs < n
    gl.store(out_ptr + offs, gl.load(in_ptr + offs, mask=mask) * 2, mask=mask)


x = torch.randn(10000, device="cuda")
y = torch.empty_like(x)
copy_kernel[(triton.cdiv(x.numel(), 512),)](x, y, x.numel(), BLOCK=512, num_warps=4)
print("smoke copy kernel equal:", bool(torch.equal(y, x * 2)))
