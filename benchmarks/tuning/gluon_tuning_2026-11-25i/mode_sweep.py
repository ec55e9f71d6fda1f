"""The backward with dQ recomputed against dQ added by the dK/dV kernel, and what "auto" picks, per input (H100/H200).

    python benchmarks/tuning/gluon_tuning_2026-11-25i/mode_sweep.py "16,8192,1024;8,12288,2048"

Each input is N,P,R (one prompt of P tokens, N responses of R), bf16, Hq 32 / Hkv 8, D 128; the whole backward
timed by triton.testing.do_bench (warm-up 50 ms, 300 ms), both modes in one process, alternated twice.
"""
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
import attention as bench  # noqa: E402
from dualkv_compile.kernels.device import sm_count  # noqa: E402
from dualkv_compile.kernels.gluon import attention as ga  # noqa: E402

cfg = bench.Cfg(32, 8, 128, torch.bfloat16, torch.device("cuda"))
modes = {"recompute": ga.DkdvConfig(dq_mode="recompute"), "atomic": ga.DkdvConfig(dq_mode="atomic")}
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
for shape in sys.argv[1].split(";"):
    case = bench.uniform_case(*(int(x) for x in shape.split(",")))
    q, k, v = [t.detach() for t in bench._packed(case, cfg)]
    segs = bench.segments(case, cfg.device)
    out, lse = ga.forward(q, k, v, segs, cfg.scale)
    do = torch.randn_like(q)
    sms = sm_count(q.device)
    waves = -(-segs.max_prefix_len // 128) * cfg.hkv / sms
    auto = ga.resolve_dq_mode(ga.DkdvConfig(), False, cfg.d, segs.max_prefix_len, cfg.hkv, sms)
    ms = {name: [] for name in modes}
    for _ in range(2):
        for name, c in modes.items():
            fn = lambda: ga.backward(do, q, k, v, out, lse, segs, cfg.scale, dkdv_config=c)  # noqa: E731
            ms[name].append(triton.testing.do_bench(fn, warmup=50, rep=300))
    r, a = min(ms["recompute"]), min(ms["atomic"])
    print(f"{case.name:24s} waves {waves:5.2f} auto={auto:9s} recompute {r:8.3f} ms  atomic {a:8.3f} ms  "
          f"atomic/recompute {a / r:.3f}", flush=True)
    del q, k, v, out, lse, do
    torch.cuda.empty_cache()
