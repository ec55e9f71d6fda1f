"""Time the split dQ against the recomputing and atomic backward (dev only)."""
import sys
import torch
import triton
sys.path.insert(0, "benchmarks")
import attention as bench  # noqa: E402
from dualkv_compile.kernels.gluon import attention as ga  # noqa: E402

cfg = bench.Cfg(32, 8, 128, torch.bfloat16, torch.device("cuda"))
modes = {"recompute": ga.DkdvConfig(), "atomic": ga.DkdvConfig(dq_mode="atomic")}
for r in [int(x) for x in sys.argv[1].split(",")]:
    modes[f"split{r}"] = ga.DkdvConfig(dq_mode="split", split_min_rows=r)
shapes = sys.argv[2].split(";") if len(sys.argv) > 2 else ["16,32768,2048", "16,32768,1024", "28,16384,1024",
                                                              "8,2048,2048", "tree", "groups"]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


for shape in shapes:
    shape = tuple(int(x) for x in shape.split(",")) if "," in shape else shape
    case = bench.case_for(shape, cfg.device)
    q, k, v = [t.detach() for t in bench._packed(case, cfg)]
    segs = bench.segments(case, cfg.device)
    out, lse = ga.forward(q, k, v, segs, cfg.scale)
    do = torch.randn_like(q)
    flops = case.pairs_after * 4 * cfg.d * cfg.hq * 2.5
    ref = ga.backward(do, q, k, v, out, lse, segs, cfg.scale)
    line = []
    for name, c in modes.items():
        fn = lambda: ga.backward(do, q, k, v, out, lse, segs, cfg.scale, dkdv_config=c)  # noqa: E731
        got = fn()
        d = max(rel(g, r) for g, r in zip(got, ref))
        ms = triton.testing.do_bench(fn, warmup=50, rep=300)
        line.append(f"{name} {ms:.3f} ({flops / ms / 1e9:.0f}, d{d:.0e})")
    print(f"{case.name:34s} " + "  ".join(line), flush=True)
    del q, k, v, out, lse, do, ref
    torch.cuda.empty_cache()
