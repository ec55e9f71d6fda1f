"""Host time (GPU kept busy) of each piece of the gluon op's forward and backward."""
import statistics, sys, time
import torch
sys.path.insert(0, "benchmarks")
import attention as bench
from dualkv_compile.ops import attention as A
from dualkv_compile.kernels.gluon import attention as G
from dualkv_compile.kernels.triton import attention as TA
from dualkv_compile.kernels.common.schedule import tile_schedule, ancestor_walk

cfg = bench.Cfg(32, 8, 128, torch.bfloat16, torch.device("cuda"))
case = bench.uniform_case(8, 2048, 2048)
q, k, v = bench._packed(case, cfg)
segs = bench.segments(case, cfg.device)
sc = cfg.scale

def host(f, n=20):
    f(); torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        torch.cuda._sleep(int(5e6))
        t0 = time.perf_counter(); f(); ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)

with torch.no_grad():
    out, lse = G.forward(q, k, v, segs, sc)
dout = torch.randn_like(out)
parts = {}
with torch.no_grad():
    parts["G.forward"] = host(lambda: G.forward(q, k, v, segs, sc))
    parts["A.attention_fwd (custom op, no grad)"] = host(lambda: A.attention_fwd(q, k, v, *segs, sc, 0.0, "gluon"))
    parts["shared_prompt_attention (no grad)"] = host(lambda: A.shared_prompt_attention(q, k, v, segs, sc, backend="gluon"))
    parts["resolve_backend gluon"] = host(lambda: A.resolve_backend("gluon", q, v))
    parts["G.supports"] = host(lambda: G.supports(q, v))
    parts["_descriptor x1"] = host(lambda: G._descriptor(q, 128))
    parts["tile_schedule (cached)"] = host(lambda: tile_schedule(segs, q.shape[2], 128, "q"))
    parts["torch.empty x1"] = host(lambda: torch.empty((1, 32, q.shape[2], 128), dtype=q.dtype, device=q.device))
    parts["G.backward"] = host(lambda: G.backward(dout, q, k, v, out, lse, segs, sc))
    parts["A.attention_bwd (custom op)"] = host(lambda: A.attention_bwd(dout, q, k, v, out, lse, *segs, sc, 0.0, "gluon", False))
    parts["row_statistics"] = host(lambda: TA.row_statistics(out, dout, lse, pack=True))
    parts["lse.float().contiguous()"] = host(lambda: lse.float().contiguous())
    parts["TA._check"] = host(lambda: TA._check(q, k, segs))
o = A.shared_prompt_attention(q, k, v, segs, sc, backend="gluon")
parts["fwd with grad"] = host(lambda: A.shared_prompt_attention(q, k, v, segs, sc, backend="gluon"))
parts["fwd+bwd autograd"] = host(lambda: torch.autograd.grad(A.shared_prompt_attention(q, k, v, segs, sc, backend="gluon"), (q, k, v), dout))
for k_, t in parts.items():
    print(f"{t:9.1f} us  {k_}")
