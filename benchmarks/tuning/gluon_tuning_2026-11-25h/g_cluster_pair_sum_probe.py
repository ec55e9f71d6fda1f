"""Probe (CPU, no GPU needed): can Gluon sum a dQ tile over a 2-CTA cluster through distributed shared memory?

Each CTA of a cluster of two holds one float32 [64, 128] partial (the CGA layout puts dim 0 of a [2, 64, 128]
tensor on the CTA id); ``convert_layout`` to a layout that splits the rows over the CTAs instead is the exchange,
and a sum over dim 0 leaves each CTA half the rows summed: half the bulk reductions of the atomic dQ option.
Compiled for sm_90 the way ``benchmarks/sm90_resources.py`` does; prints what the PTX holds.
Run from the repository root: ``python benchmarks/tuning/gluon_tuning_2026-11-25h/g_cluster_pair_sum_probe.py``.
"""
import sys, torch, triton
sys.path.insert(0, "benchmarks")
import sm90_resources as S
from triton.runtime.driver import driver
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

driver.set_active(S._Sm90Driver())
compiled = []
S._compile_only(compiled)

@gluon.jit
def pair_sum(x_ptr, out_ptr, R: gl.constexpr, C: gl.constexpr):
    # x: [2, R, C] float32, CTA c of the pair holds x[c] (its partial dQ tile)
    L_in: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, 4, 1], [2, 1, 0], cga_layout=[[1, 0, 0]])
    L_out: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, 4, 1], [2, 1, 0], cga_layout=[[0, 1, 0]])
    a = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, L_in)))
    r = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_in)))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_in)))
    offs = a[:, None, None] * (R * C) + r[None, :, None] * C + c[None, None, :]
    x = gl.load(x_ptr + offs)
    y = gl.convert_layout(x, L_out)          # the exchange: each CTA now holds both partials of half the rows
    s = gl.sum(y, axis=0)                     # [R, C], rows split over the pair
    L2: gl.constexpr = gl.SliceLayout(0, L_out)
    r2 = gl.arange(0, R, layout=gl.SliceLayout(1, L2))
    c2 = gl.arange(0, C, layout=gl.SliceLayout(0, L2))
    gl.store(out_ptr + r2[:, None] * C + c2[None, :], s)

x = torch.empty(2, 64, 128, dtype=torch.float32)
o = torch.empty(64, 128, dtype=torch.float32)
try:
    pair_sum[(2,)](x, o, 64, 128, num_warps=4, num_ctas=2)
    k = compiled[-1][1]
    ptx = k.asm["ptx"]
    import re
    for pat in ["mapa", "ld.shared::cluster", "st.shared::cluster", "st.async", "barrier.cluster"]:
        print(pat, len(re.findall(re.escape(pat), ptx)))
    print(k.metadata.num_ctas, getattr(k.metadata, "cluster_dims", None))
except Exception as e:
    import traceback; traceback.print_exc()
