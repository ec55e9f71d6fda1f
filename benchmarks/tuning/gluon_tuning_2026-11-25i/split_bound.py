"""Bounds for a split dQ: ancestors' blocks by atomic dQ in dK/dV, own blocks in the dQ kernel (dev only)."""
import sys
import torch
import triton
sys.path.insert(0, "benchmarks")
import attention as bench  # noqa: E402
from dualkv_compile.kernels.gluon import attention as ga  # noqa: E402
from dualkv_compile.kernels.common import schedule as sched  # noqa: E402

cfg = bench.Cfg(32, 8, 128, torch.bfloat16, torch.device("cuda"))
real_walk = ga.ancestor_walk


def own_walk(segs, block):
    w = real_walk(segs, block).clone()
    w[:, :2] = 0
    return w


def kernel_ms(fn):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            out[e.key[:40]] = e.device_time_total / 1e3 / 3
    return out


shapes = [(16, 32768, 2048), (16, 32768, 1024), (28, 16384, 1024), (8, 2048, 2048), "tree", "groups"]
for shape in shapes:
    case = bench.case_for(shape, cfg.device)
    q, k, v = [t.detach() for t in bench._packed(case, cfg)]
    segs = bench.segments(case, cfg.device)
    out, lse = ga.forward(q, k, v, segs, cfg.scale)
    do = torch.randn_like(q)
    flops = case.pairs_after * 4 * cfg.d * cfg.hq * 2.5
    rec = lambda: ga.backward(do, q, k, v, out, lse, segs, cfg.scale)  # noqa: E731
    atom = lambda: ga.backward(do, q, k, v, out, lse, segs, cfg.scale,  # noqa: E731
                               dkdv_config=ga.DkdvConfig(dq_mode="atomic"))
    res = {}
    res["default"] = triton.testing.do_bench(rec, warmup=50, rep=300)
    res["atomic"] = triton.testing.do_bench(atom, warmup=50, rep=300)
    kd = kernel_ms(rec)
    ka = kernel_ms(atom)
    ga.ancestor_walk = own_walk
    try:
        res["default_ownwalk"] = triton.testing.do_bench(rec, warmup=50, rep=300)
        ko = kernel_ms(rec)
    finally:
        ga.ancestor_walk = real_walk
    print(f"== {case.name}: pairs {case.pairs_after}", flush=True)
    for n, ms in res.items():
        print(f"   {n:18s} {ms:8.3f} ms  {flops / ms / 1e9:5.0f} TF/s", flush=True)
    for n, d in (("default kernels", kd), ("atomic kernels", ka), ("own-walk kernels", ko)):
        print(f"   {n}: " + "; ".join(f"{k} {v:.3f}" for k, v in sorted(d.items(), key=lambda x: -x[1])[:5]), flush=True)
    del q, k, v, out, lse, do
    torch.cuda.empty_cache()
