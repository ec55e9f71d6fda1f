"""Host-side cost of one attention call: how much of ``benchmarks/ops/attention.py``'s time is the CPU's.

``attention.py`` times each call alone (CUDA events around it, then a sync), so
the host work before a call's first kernel (argument checks, dispatch,
descriptors, the launch itself) counts when the GPU is idle at the start.
This script separates the two, per method and case:

    exposed   attention.py's "from idle" measure: events around one call from an idle GPU, median
    warm      attention.py's headline measure: the same, queued behind a short GPU sleep (the host's
              work before the first kernel hidden, the GPU not idle at the start), median
    device    the same calls queued behind a 30 ms GPU sleep, so the host runs ahead and
              only the kernels count: events around 8 calls / 8
    host      wall time of one call's Python (no sync) while the GPU is busy, median
    gap       exposed - device: what the host adds to the from-idle figure

With ``--profile METHOD`` it also prints cProfile's top entries of that
method's forward and forward+backward (host time, the GPU kept busy).

    python benchmarks/ops/op_overhead.py --methods sdpa_cudnn_dup,dualkv_gluon --shapes 8,2048,2048
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks import harness  # noqa: E402
from benchmarks.ops import attention as bench  # noqa: E402  (benchmarks/ops/attention.py: cases, methods, timing, from attention_methods/_timing)


def measure(fn, reps: int = 8) -> dict:
    warm, exposed = bench.time_ms(fn, torch.device("cuda"), 200.0, 5, 20)  # (queued, from idle)
    host = []
    for _ in range(reps):
        bench.gpu_sleep(30)
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    bench.gpu_sleep(30)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    device = s.elapsed_time(e) / reps
    return dict(exposed=exposed, warm=warm, device=device, host=statistics.median(host), gap=exposed - device)


def profile(fn, title: str, top: int) -> None:
    fn()
    torch.cuda.synchronize()
    bench.gpu_sleep(60)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    print(f"\n### cProfile, {title} (5 calls, by own time)\n```\n{buf.getvalue().strip()}\n```")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="sdpa_cudnn_dup,dualkv_gluon")
    ap.add_argument("--shapes", action="append", type=bench.parse_shape)
    ap.add_argument("--profile", default=None, help="a method whose forward and fwd+bwd get a cProfile listing")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (it measures the host's share of GPU timings)")
    cfg = bench.Cfg(32, 8, 128, torch.bfloat16, torch.device("cuda"))
    cases = [bench.case_for(s, cfg.device) for s in args.shapes or [(8, 2048, 2048)]]
    methods = bench.methods_for(cfg)
    print("\n".join(harness.markdown_stamp(harness.stamp("op_overhead", device="cuda", script=__file__, argv=argv))))
    print("- Hq 32, Hkv 8, D 128, bf16; ms per call\n")
    print("| case | method | mode | exposed | warm | device | host | gap | gap / exposed |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case in cases:
        for name in args.methods.split(","):
            fn, leaves, _, _ = methods[name](case, cfg)
            douts = [torch.randn_like(o) for o in fn()]

            def fwd_bwd(fn=fn, leaves=leaves, douts=douts):
                return torch.autograd.grad(fn(), leaves, douts)

            def fwd(fn=fn):
                with torch.no_grad():
                    return fn()

            for mode, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                r = measure(f)
                cells = " | ".join(f"{r[k]:.3f}" for k in ("exposed", "warm", "device", "host", "gap"))
                print(f"| {case.name} | {name} | {mode} | {cells} | {r['gap'] / r['exposed']:.1%} |", flush=True)
                if name == args.profile:
                    profile(f, f"{name} {mode} {case.name}", args.top)
            fn = leaves = douts = None
            bench._free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
