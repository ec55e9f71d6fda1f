"""``dualkv::linear_log_prob`` against the unfused lm_head -> log_softmax -> gather: error, time, peak memory.

Forward + backward of next-token log-probs for T tokens (the upstream
gradient random), bf16 hidden states and lm_head weight, the loss's
``/ temperature`` then ``.float()``. Unfused: the ops as a policy loss writes
them, compiled with Inductor (what the packed graph ran before the fusion).
Error: relative to a float32 computation of the same, for both.

    python benchmarks/ops/linear_log_prob.py [--tokens 20480] [--hidden 1024] [--vocab 151936] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks import harness  # noqa: E402
from dualkv_compile.kernels.linear_log_prob import linear_log_prob_reference  # noqa: E402
from dualkv_compile.ops.linear_log_prob import linear_log_prob  # noqa: E402


def log(msg):
    print(f"[linear_log_prob {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="default: benchmarks/results/linear_log_prob/<device>-<date>/ (benchmarks/harness.py)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    stamp = harness.stamp("linear_log_prob", device="cuda", script=__file__, argv=argv)
    args.out = args.out or harness.result_dir(stamp)
    dev, T, H, V = "cuda", args.tokens, args.hidden, args.vocab
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = (torch.randn(T, H, device=dev, generator=g)).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, device=dev, generator=g) / H**0.5).bfloat16().requires_grad_()
    rows = torch.arange(T, device=dev)
    index = torch.randint(0, V, (T, 1), device=dev, generator=g)
    up = torch.randn(T, 1, device=dev, generator=g)
    post = dict(scale=0.7, divide=True, scale_first=True, upcast=True)
    unfused = torch.compile(lambda h, w, r, i: linear_log_prob_reference(h, w, r, i, **post), dynamic=False)
    fused = lambda h, w, r, i: linear_log_prob(h, w, r, i, **post)  # noqa: E731

    def grads(fn, h, w):
        out = fn(h, w, rows, index)
        dh, dw = torch.autograd.grad((out.float() * up).sum(), (h, w))
        return out, dh, dw

    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    truth = grads(lambda h, w, r, i: linear_log_prob_reference(h, w, r, i, **post), h32, w32)
    meta = {"tokens": T, "hidden": H, "vocab": V, "device": stamp["device"], "torch": stamp["versions"]["torch"]}
    result = {}
    for name, fn in (("unfused_inductor", unfused), ("fused", fused)):
        got = grads(fn, hidden, weight)
        errs = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, truth)]
        del got
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out, dh, dw = grads(fn, hidden, weight)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            del out, dh, dw
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        result[name] = dict(ms=statistics.median(times), peak_gb_above_inputs=peak, rel_err_out_dh_dw=errs)
        log(f"{name}: {statistics.median(times):.2f} ms fwd+bwd, peak {peak:.2f} GB above inputs, rel err (out, dh, dw) {['%.1e' % e for e in errs]}")
    harness.write_json(os.path.join(args.out, "linear_log_prob.json"), harness.record(stamp, meta=meta, results=result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
