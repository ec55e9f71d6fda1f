"""Windowed shared-prompt attention (gpt-oss's sliding layers), side by side with what a user runs instead.

One process, bf16, forward + backward, for each (N responses of R, prompt P, window w) case:

    flex_dup_window   FlexAttention over the N duplicated rows back to back (one row, document ids), the sliding
                      window and causality in its mask_mod, block mask built once outside the timed region:
                      the strongest windowed baseline this machine runs (no FlashAttention wheel with windows)
    sdpa_cudnn_dup    SDPA's cuDNN kernel on the duplicated [N, P+R] batch, causal, *no window* (labelled: it
                      computes every pair, so it bounds what a window-less kernel costs)
    dualkv_<backend>  shared_prompt_attention on the packed forest with the window (each backend that runs it),
                      and with gpt-oss's sinks too (the sinks' epilogue and gradient included)

Reports the median ms (triton.testing.do_bench), the useful TFLOP/s of the packed layout (its window-visible
pairs x 4 x D x Hq, fwd+bwd 3.5x the forward), and each method against flex_dup_window. Writes
``window_attention.{json,md}`` to ``--out``.

    python benchmarks/ops/window_attention.py                  # the default cases on CUDA
    python benchmarks/ops/window_attention.py --cases 8,8192,1024,128
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402
from dualkv_compile.layout import tree_segments  # noqa: E402
from dualkv_compile.ops.attention import unsupported_reason  # noqa: E402

# (N, P, R, window): gpt-oss's 128-token window at 6-8K prompts; a wider window (Gemma's 1024).
CASES = [(8, 8192, 1024, 128), (8, 6144, 512, 128), (8, 8192, 1024, 1024)]
HQ, HKV, D = 64, 8, 64  # gpt-oss-20b's attention


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def window_pairs(n: int, w: int) -> int:
    """Pairs a sequence of n tokens computes under a causal window of w: sum over i of min(i + 1, w)."""
    full = min(n, w)
    return full * (full + 1) // 2 + max(0, n - w) * w


def packed_pairs(P: int, Rs: list[int], w: int) -> int:
    """The forest's visible pairs: the prompt's once, each response token's (its window over prompt and response)."""
    return window_pairs(P, w) + sum(window_pairs(P + R, w) - window_pairs(P, w) for R in Rs)


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def fwd_bwd(f, inputs, dout):
    def step():
        for t in inputs:
            t.grad = None
        f().backward(dout)
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", action="append", help="N,P,R,window (repeatable)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/window_attention/<device>-<date>/ (benchmarks/harness.py)")
    args = ap.parse_args(argv)
    stamp = harness.stamp("window_attention", device="cuda", script=__file__, argv=argv)
    args.out = args.out or harness.result_dir(stamp)
    cases = [tuple(int(x) for x in c.split(",")) for c in args.cases] if args.cases else CASES
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for N, P, R, w in cases:
        g = torch.Generator().manual_seed(0)
        Rs = [int(x) for x in torch.randint(R // 2, R + 1, (N,), generator=g)]
        segs = tree_segments([P] + Rs, [-1] + [0] * N, dev)
        T = P + sum(Rs)
        pairs = packed_pairs(P, Rs, w)
        dup_pairs = sum(window_pairs(P + r, w) for r in Rs)
        flop = 3.5 * 4 * D * HQ * pairs
        q = torch.randn(1, HQ, T, D, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(1, HKV, T, D, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(1, HKV, T, D, device=dev, dtype=dt, requires_grad=True)
        sinks = torch.randn(HQ, device=dev, dtype=torch.float32, requires_grad=True)
        dout = torch.randn(1, HQ, T, D, device=dev, dtype=dt)
        res = {}
        # Duplicated rows back to back, for flex with document ids; the same values per row as the forest's.
        idx = torch.cat([torch.cat([torch.arange(P), P + sum(Rs[:i]) + torch.arange(r)]) for i, r in enumerate(Rs)]).to(dev)
        doc = torch.cat([torch.full((P + r,), i) for i, r in enumerate(Rs)]).to(dev)
        depth = torch.cat([torch.arange(P + r) for r in Rs]).to(dev)
        Td = idx.numel()
        qd, kd, vd = (t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v))
        dd = dout[:, :, idx]

        def doc_window(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (ki <= qi) & (depth[qi] - depth[ki] < w)

        bm = create_block_mask(doc_window, 1, 1, Td, Td, device=dev)
        scale = D ** -0.5
        methods = {"flex_dup_window": (lambda: flex(qd, kd, vd, block_mask=bm, scale=scale, enable_gqa=True), (qd, kd, vd), dd)}
        # cuDNN on the padded duplicated batch, no window (labelled).
        S = P + max(Rs)
        qb, kb, vb = (torch.randn(N, h, S, D, device=dev, dtype=dt, requires_grad=True) for h in (HQ, HKV, HKV))
        db = torch.randn(N, HQ, S, D, device=dev, dtype=dt)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        methods["sdpa_cudnn_dup (no window)"] = (cudnn, (qb, kb, vb), db)
        for backend in ("triton", "flex", "gluon"):
            why = unsupported_reason(backend, q, v, window=w)
            if why is not None:
                log(f"N={N} P={P} R={R} w={w}: {backend} skipped: {why}")
                continue
            methods[f"dualkv_{backend}"] = (
                lambda b=backend: dualkv_compile.shared_prompt_attention(q, k, v, segs, scale, backend=b, window=w), (q, k, v), dout)
            if unsupported_reason(backend, q, v, window=w, sinks=True) is None:
                methods[f"dualkv_{backend} + sinks"] = (
                    lambda b=backend: dualkv_compile.shared_prompt_attention(q, k, v, segs, scale, backend=b, window=w, sinks=sinks),
                    (q, k, v, sinks), dout)
        for name, (f, ins, do) in methods.items():
            try:
                ms = bench(fwd_bwd(f, ins, do))
            except Exception as e:  # noqa: BLE001  (a method that cannot run is reported, the others still run)
                log(f"{name}: failed: {type(e).__name__}: {e}")
                res[name] = None
                continue
            res[name] = ms
            log(f"N={N} P={P} R={R} w={w} {name}: {ms:.2f} ms, {flop / ms / 1e9:.0f} TFLOP/s useful")
        base = res.get("flex_dup_window")
        for name, ms in res.items():
            rows.append(dict(N=N, P=P, R=R, window=w, T=T, method=name, ms=ms, ideal=dup_pairs / pairs,
                             tflops=None if ms is None else flop / ms / 1e9,
                             vs_flex_dup=None if ms is None or base is None else base / ms))
    meta = dict(date=stamp["date"], device=stamp["device"], torch=stamp["versions"]["torch"],
                triton=stamp["versions"]["triton"], heads=(HQ, HKV), head_dim=D, dtype="bfloat16")
    harness.write_json(os.path.join(args.out, "window_attention.json"), harness.record(stamp, meta=meta, rows=rows))
    lines = [f"# Windowed attention, gpt-oss-20b heads ({HQ}/{HKV}, D={D}), bf16 fwd+bwd ({meta['device']}, torch {meta['torch']}, "
             f"triton {meta['triton']}, {meta['date']})", "",
             "| N x (P + R), window | method | ms | useful TFLOP/s | x flex_dup_window | pair ideal |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ms = "failed" if r["ms"] is None else f"{r['ms']:.2f}"
        tf = "-" if r["tflops"] is None else f"{r['tflops']:.0f}"
        vs = "-" if r["vs_flex_dup"] is None else f"{r['vs_flex_dup']:.2f}"
        lines.append(f"| {r['N']} x ({r['P']} + {r['R']}), {r['window']} | {r['method']} | {ms} | {tf} | {vs} | {r['ideal']:.2f} |")
    with open(os.path.join(args.out, "window_attention.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
