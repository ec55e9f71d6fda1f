"""Check and time the shared-prompt Triton kernels on a GPU, beside FlexAttention and SDPA.

    PYTHONUNBUFFERED=1 python benchmarks/tuning/triton_tune.py [--out DIR] [--quick]
    python benchmarks/tuning/triton_tune.py --sweep-only --variants 'kv32' --head-dim 64   # part of a sweep
    python benchmarks/tuning/triton_tune.py --skip-sweep --config "Config(KC(...), KC(...), KC(...))"

1. correctness at moderate size (several groups, ragged lengths, GQA, D=64/128)
   against the fp32 reference, for the table's configs and every variant
   swept (checked before it is timed), both backward modes, and bitwise
   determinism of the deterministic backward;
2. a sweep of forward / backward configs on three shapes (``--variants``
   selects by name, ``--head-dim`` 64 or 128), its pick checked again, and a
   profile of the kernels' times in one forward + backward;
3. the target shapes (bf16, Hq=32, Hkv=8, D=128): Triton (the sweep's pick,
   or ``--config``) vs FlexAttention (two-region BlockMask, compiled for each
   shape) vs SDPA on the unpacked padded batch. Useful FLOPs = attention
   pairs x 4 x D x Hq, backward 2.5x forward.
Writes JSON lines and a summary table under --out. The variants of each
tuning run and what they measured: benchmarks/results/triton_tune/h200-2026-11-22/triton_tuning.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from benchmarks import harness  # noqa: E402
from dualkv_compile.layout import tree_segments  # noqa: E402
from dualkv_compile.kernels import reference  # noqa: E402
from dualkv_compile.kernels.triton import attention as ta  # noqa: E402
from dualkv_compile.kernels.triton.attention import Config, KernelConfig as KC  # noqa: E402

TARGETS = [(16, 4096, 1024), (28, 16384, 1024), (16, 32768, 1024), (8, 2048, 2048), (28, 4096, 2048), (16, 32768, 2048)]
OUT = None
LOG = []


def emit(**rec):
    LOG.append(rec)
    print(json.dumps(rec), flush=True)
    if OUT:
        with open(os.path.join(OUT, "results.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")


def make_segments(groups, device="cuda"):
    """groups: [(P, [R0, R1, ...])] -> Segments, T, attention pairs."""
    lens, parents, pairs = [], [], 0
    for P, Rs in groups:
        root = len(lens)
        lens.append(P)
        parents.append(-1)
        pairs += P * (P + 1) // 2
        for R in Rs:
            lens.append(R)
            parents.append(root)
            pairs += P * R + R * (R + 1) // 2
    return tree_segments(lens, parents, device), sum(lens), pairs


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench(fn, ms=200):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=ms, return_mode="median")


def qkv(T, Hq, Hkv, D, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, Hq, T, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(1, Hkv, T, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(1, Hkv, T, D, device="cuda", dtype=dtype, generator=g)
    do = torch.randn(1, Hq, T, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v, do


# ----------------------------------------------------------------------------- correctness


def check(cfg: Config, name: str, D=128, Hq=32, Hkv=8, dtype=torch.bfloat16):
    segs, T, _ = make_segments([(1500, [300, 517, 1, 211]), (700, [900, 33]), (129, [64, 1000])])
    q, k, v, do = qkv(T, Hq, Hkv, D, dtype, seed=D)
    # non-contiguous q: [T, H, D] storage viewed as [1, H, T, D]
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    scale = 1 / math.sqrt(D)
    ro, rl = reference.reference_forward(q.float(), k.float(), v.float(), segs, scale)
    rg = reference.reference_backward(do.float(), q.float(), k.float(), v.float(), None, None, segs, scale)
    o, lse = ta.forward(q, k, v, segs, scale, config=cfg)
    res = dict(kind="check", name=name, D=D, out=rel(o, ro), lse=rel(lse, rl))
    for det in (True, False):
        g = ta.backward(do, q, k, v, o, lse, segs, scale, det, config=cfg)
        res[f"grads_det{int(det)}"] = [rel(a, b) for a, b in zip(g, rg)]
        if det:
            g2 = ta.backward(do, q, k, v, o, lse, segs, scale, det, config=cfg)
            res["bitwise"] = all(torch.equal(a, b) for a, b in zip(g, g2))
    errs = [res["out"], res["lse"]] + res["grads_det0"] + res["grads_det1"]
    res["ok"] = all(e < 1e-2 for e in errs) and res["bitwise"] and all(math.isfinite(e) for e in errs)
    emit(**res)
    return res["ok"]


# ----------------------------------------------------------------------------- baselines


def flex_setup(segs, T):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seg_id = torch.repeat_interleave(torch.arange(segs.seg_len.numel(), device="cuda"), segs.seg_len.long(), output_size=T)
    reach = segs.subtree_end.long()[seg_id]  # a key is seen by the rows from it to its segment's subtree end

    def mask_mod(b, h, qi, kv):
        return (kv <= qi) & (qi < reach[kv])

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    bm = create_block_mask(mask_mod, None, None, T, T, device="cuda")
    torch.cuda.synchronize()
    build_ms = (time.perf_counter() - t0) * 1e3
    fa = torch.compile(flex_attention)
    return (lambda q, k, v, scale: fa(q, k, v, block_mask=bm, enable_gqa=True, scale=scale)), build_ms


def sdpa_padded_ms(N, P, R, Hq, Hkv, D):
    """fwd+bwd of the unpacked batch: N rows of P+R tokens, causal, flash SDPA (k, v expanded to Hq)."""
    S = P + R
    q = torch.randn(N, Hq, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(N, Hq, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(N, Hq, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(N, Hq, S, D, device="cuda", dtype=torch.bfloat16)
    F = torch.nn.functional

    def step():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(do)

    step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); step(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    del q, k, v, do
    torch.cuda.empty_cache()
    return sorted(ts)[1]


# ----------------------------------------------------------------------------- timing


def profile_kernels(*configs, shapes=((28, 16384, 1024), (16, 4096, 1024)), D=128):
    """GPU time per kernel (and per helper op) of one forward + backward, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    Hq, Hkv = 32, 8
    for shape in shapes:
        N, P, R = shape
        segs, T, _ = make_segments([(P, [R] * N)])
        q, k, v, do = qkv(T, Hq, Hkv, D)
        for cfg in configs:
            def step():
                o, lse = ta.forward(q, k, v, segs, 1 / math.sqrt(D), config=cfg)
                ta.backward(do, q, k, v, o, lse, segs, 1 / math.sqrt(D), False, config=cfg)

            step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            per = {}
            for e in prof.key_averages():
                if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
                    t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                    if t:
                        per[e.key[:60]] = round(t / 3 / 1e3, 3)
            emit(kind="profile", shape=shape, cfg=str(cfg), ms_per_step=per)
        del q, k, v, do
        torch.cuda.empty_cache()


def time_triton(segs, T, q, k, v, do, scale, cfg, det):
    o, lse = ta.forward(q, k, v, segs, scale, config=cfg)
    fwd = bench(lambda: ta.forward(q, k, v, segs, scale, config=cfg))
    bwd = bench(lambda: ta.backward(do, q, k, v, o, lse, segs, scale, det, config=cfg))
    return fwd, bwd


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="default: benchmarks/results/triton_tune/<device>-<date>/ (benchmarks/harness.py)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--skip-sdpa", action="store_true")
    ap.add_argument("--sweep-only", action="store_true", help="stop after the sweep and the kernel profile")
    ap.add_argument("--variants", default="", help="regex: sweep only the variants whose names match")
    ap.add_argument("--skip-table-checks", action="store_true")
    ap.add_argument("--check-only", action="store_true", help="check the selected variants, time nothing")
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128), help="head dim of the sweep")
    ap.add_argument("--config", default=None, help="a Config(...) expression to time on the target shapes")
    args = ap.parse_args()
    stamp = harness.stamp("triton_tune", device="cuda", script=__file__)
    OUT = args.out or harness.result_dir(stamp)
    os.makedirs(OUT, exist_ok=True)
    versions = stamp["versions"]
    emit(kind="env", device=stamp["device"], torch=versions["torch"], triton=versions["triton"], cuda=versions["cuda"],
         date=stamp["date"], command=stamp["command"], sms=torch.cuda.get_device_properties(0).multi_processor_count)
    table = ta.config_for(torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16))
    emit(kind="table", cfg=str(table))

    # --- correctness of the table configs, D=64 and 128
    for D in (() if args.skip_table_checks else (64, 128)):
        cfg = ta.config_for(torch.empty(1, 1, 1, D, device="cuda", dtype=torch.bfloat16))
        for variant, c in (("table", cfg), ("atomic_dq", Config(cfg.fwd, cfg.dkdv, cfg.dq, 1, "atomic")),
                           ("head_split2", Config(cfg.fwd, cfg.dkdv, cfg.dq, 2, "recompute"))):
            try:
                check(c, f"{variant}-D{D}", D=D)
            except Exception:
                emit(kind="check", name=f"{variant}-D{D}", error=traceback.format_exc()[-2000:])
    try:
        if not args.skip_table_checks:
            check(ta.config_for(torch.empty(1, 1, 1, 96, device="cuda", dtype=torch.float16)), "table-D96-fp16",
                  D=96, dtype=torch.float16)
    except Exception:
        emit(kind="check", name="D96", error=traceback.format_exc()[-2000:])

    Hq, Hkv, D = 32, 8, args.head_dim
    scale = 1 / math.sqrt(D)
    table = ta.config_for(torch.empty(1, 1, 1, D, device="cuda", dtype=torch.bfloat16))
    # Run 5 (2026-11-24): tensor-descriptor (TMA) loads, tiles that compile without spills or fit
    # two programs per SM (benchmarks/tuning/sm90_resources.py reports registers, spills and shared memory
    # without a GPU), and packed row statistics for the dK/dV kernel. Earlier runs' variants and
    # what they measured: benchmarks/results/triton_tune/h200-2026-11-22/triton_tuning.md.
    T, S = dict(tma=True), dict(tma=True, stats_tma=True)
    fwd_variants = {"f128x128w8s3": KC(128, 128, 8, 3), "f128x128w8s3t": KC(128, 128, 8, 3, **T),
                    "f128x64w8s3t": KC(128, 64, 8, 3, **T)}
    q_table = KC(128, 64, 8, 3)
    # name: (dK/dV config, dQ config, head_split)
    bwd_variants = {
        "kv64x128w8s3-hs2": (KC(64, 128, 8, 3), q_table, 2),
        "kv32x64w4s3t-stats-hs1": (KC(32, 64, 4, 3, **S), q_table, 1),
        "kv32x64w4s4t-stats-hs1": (KC(32, 64, 4, 4, **S), q_table, 1),
        "kv32x64w4s3t-stats-hs2": (KC(32, 64, 4, 3, **S), q_table, 2),
        "kv32x128w8s3t-stats-hs1": (KC(32, 128, 8, 3, **S), q_table, 1),
        "q128x64w8s3t": (KC(32, 64, 4, 3, **S), KC(128, 64, 8, 3, **T), 1),
    }
    if D == 64:
        fwd_variants = {"f128x64w4s3": KC(128, 64, 4, 3), "f128x64w4s3t": KC(128, 64, 4, 3, **T),
                        "f128x128w8s3t": KC(128, 128, 8, 3, **T), "f128x64w8s3t": KC(128, 64, 8, 3, **T)}
        bwd_variants = {
            "kv64x128w8s3-hs2": (KC(64, 128, 8, 3), q_table, 2),
            "kv32x64w4s3t-stats-hs1": (KC(32, 64, 4, 3, **S), q_table, 1),
            "kv64x64w4s3t-stats-hs1": (KC(64, 64, 4, 3, **S), q_table, 1),
            "kv64x64w4s2t-stats-hs1": (KC(64, 64, 4, 2, **S), q_table, 1),
            "kv64x128w8s3t-stats-hs1": (KC(64, 128, 8, 3, **S), q_table, 1),
            "kv64x128w8s3t-stats-hs2": (KC(64, 128, 8, 3, **S), q_table, 2),
            "kv32x128w8s3t-stats-hs1": (KC(32, 128, 8, 3, **S), q_table, 1),
            "q128x64w8s3t": (KC(64, 128, 8, 3), KC(128, 64, 8, 3, **T), 2),
        }
    import re

    fwd_variants = {k_: v_ for k_, v_ in fwd_variants.items() if re.search(args.variants, k_)}
    bwd_variants = {k_: v_ for k_, v_ in bwd_variants.items() if re.search(args.variants, k_)}
    best_fwd, best_bwd = table.fwd, (table.dkdv, table.dq, table.head_split, table.dq_mode)
    if not args.skip_sweep:
        # Every variant is checked against the reference before it is timed: a fast wrong kernel is no result.
        for name, c in fwd_variants.items():
            try:
                check(Config(c, table.dkdv, table.dq, table.head_split), f"sweep-{name}", D=D)
            except Exception:
                emit(kind="check", name=f"sweep-{name}", error=traceback.format_exc()[-1500:])
        for name, (ckv, cq, hs) in bwd_variants.items():
            try:
                check(Config(table.fwd, ckv, cq, hs), f"sweep-{name}", D=D)
            except Exception:
                emit(kind="check", name=f"sweep-{name}", error=traceback.format_exc()[-1500:])
        if args.check_only:
            return
        sweep = {}
        for shape in ([(28, 16384, 1024), (16, 4096, 1024), (8, 2048, 2048)] if not args.quick else [(8, 2048, 2048)]):
            N, P, R = shape
            segs, T, pairs = make_segments([(P, [R] * N)])
            q, k, v, do = qkv(T, Hq, Hkv, D)
            flop = pairs * 4 * D * Hq
            for name, c in fwd_variants.items():
                try:
                    cfg = Config(c, table.dkdv, table.dq)
                    ms = bench(lambda: ta.forward(q, k, v, segs, scale, config=cfg))
                    sweep.setdefault(("f", name), []).append(ms)
                    emit(kind="sweep_fwd", shape=shape, name=name, ms=ms, tflops=flop / ms / 1e9)
                except Exception:
                    emit(kind="sweep_fwd", shape=shape, name=name, error=traceback.format_exc()[-1500:])
            try:
                o, lse = ta.forward(q, k, v, segs, scale, config=Config(best_fwd, table.dkdv, table.dq))
            except Exception:
                emit(kind="sweep_bwd", shape=shape, error=traceback.format_exc()[-1500:])
                continue
            for name, (ckv, cq, hs) in bwd_variants.items():
                try:
                    cfg = Config(table.fwd, ckv, cq, hs)
                    ms = bench(lambda: ta.backward(do, q, k, v, o, lse, segs, scale, False, config=cfg), ms=400)
                    # dK/dV variants keep the table's dQ kernel and the reverse, so each family ranks on its own.
                    sweep.setdefault(("k", name), []).append(ms)
                    emit(kind="sweep_bwd", shape=shape, name=name, ms=ms, tflops=2.5 * flop / ms / 1e9)
                except Exception:
                    emit(kind="sweep_bwd", shape=shape, name=name, error=traceback.format_exc()[-1500:])
            del q, k, v, do, o, lse
            torch.cuda.empty_cache()
        # Rank by the sum over shapes of time / the shape's best time, so the long shape does not decide alone.
        nshapes = max((len(x) for x in sweep.values()), default=0)
        done = {k_: v_ for k_, v_ in sweep.items() if len(v_) == nshapes}
        low = {kind: [min(v_[i] for k_, v_ in done.items() if k_[0] == kind) for i in range(nshapes)]
               for kind in {k_[0] for k_ in done}}
        full = {k_: sum(m / lo for m, lo in zip(v_, low[k_[0]])) for k_, v_ in done.items()}
        pick = {kind: min((k_ for k_ in full if k_[0] == kind), key=full.get, default=None) for kind in "fkq"}
        if pick["f"]:
            best_fwd = fwd_variants[pick["f"][1]]
        # The dQ variants are timed beside a dK/dV variant too here: one family ("k"), whole backward configs.
        if pick["k"]:
            ckv, cq, hs = bwd_variants[pick["k"][1]]
            best_bwd = (ckv, cq, hs, "recompute")
        emit(kind="best", fwd=pick["f"], dkdv=pick["k"], dq=pick["q"], cfg=str(Config(best_fwd, *best_bwd)))
        try:
            check(Config(best_fwd, *best_bwd), f"best-D{D}", D=D)
        except Exception:
            emit(kind="check", name="best", error=traceback.format_exc()[-2000:])
        try:
            profile_kernels(Config(best_fwd, *best_bwd), table, D=D)
        except Exception:
            emit(kind="profile", error=traceback.format_exc()[-1500:])
        if args.sweep_only:
            return

    best = Config(best_fwd, *best_bwd)
    if args.config:
        best = eval(args.config, {"Config": Config, "KernelConfig": KC, "KC": KC})
        emit(kind="config", cfg=str(best))
    rows = []
    for shape in (TARGETS if not args.quick else TARGETS[:2]):
        N, P, R = shape
        try:
            segs, T, pairs = make_segments([(P, [R] * N)])
            flop = pairs * 4 * D * Hq
            q, k, v, do = qkv(T, Hq, Hkv, D)
            r = dict(kind="target", shape=shape, T=T, gflop_fwd=flop / 1e9)
            r["tri_fwd"], r["tri_bwd"] = time_triton(segs, T, q, k, v, do, scale, best, False)
            _, r["tri_bwd_det"] = time_triton(segs, T, q, k, v, do, scale, best, True)
            flex, r["flex_mask_build_ms"] = flex_setup(segs, T)
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            of = flex(qg, kg, vg, scale)
            of.backward(do)
            ot, _ = ta.forward(q, k, v, segs, scale, config=best)
            r["rel_vs_flex_out"] = rel(ot, of)
            o, lse = ta.forward(q, k, v, segs, scale, config=best)
            gt = ta.backward(do, q, k, v, o, lse, segs, scale, False, config=best)
            r["rel_vs_flex_grads"] = [rel(a, b.grad) for a, b in zip(gt, (qg, kg, vg))]
            with torch.no_grad():
                r["flex_fwd"] = bench(lambda: flex(q, k, v, scale))

            def flex_step():
                out = flex(qg, kg, vg, scale)
                out.backward(do)

            r["flex_fwdbwd"] = bench(flex_step)
            r["tri_fwdbwd"] = r["tri_fwd"] + r["tri_bwd"]
            r["tri_fwdbwd_det"] = r["tri_fwd"] + r["tri_bwd_det"]
            r["tflops_fwd"] = flop / r["tri_fwd"] / 1e9
            r["tflops_fwdbwd"] = 3.5 * flop / r["tri_fwdbwd"] / 1e9
            r["flex_tflops_fwdbwd"] = 3.5 * flop / r["flex_fwdbwd"] / 1e9
            r["ratio_fwdbwd"] = r["tri_fwdbwd"] / r["flex_fwdbwd"]
            r["ratio_fwd"] = r["tri_fwd"] / r["flex_fwd"]
            del q, k, v, do, qg, kg, vg, of, gt, o, lse
            torch.cuda.empty_cache()
            if not args.skip_sdpa:
                r["sdpa_padded_fwdbwd"] = sdpa_padded_ms(N, P, R, Hq, Hkv, D)
            emit(**r)
            rows.append(r)
        except Exception:
            emit(kind="target", shape=shape, error=traceback.format_exc()[-2000:])
            torch.cuda.empty_cache()

    lines = ["| N,P,R | T | tri fwd ms | fwd TF/s | tri fwd+bwd ms | det ms | TF/s | flex fwd ms | flex f+b ms | flex TF/s | ratio f+b | ratio fwd | sdpa padded f+b ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['T']} | {r['tri_fwd']:.2f} | {r['tflops_fwd']:.0f} | {r['tri_fwdbwd']:.2f} | "
                     f"{r['tri_fwdbwd_det']:.2f} | {r['tflops_fwdbwd']:.0f} | {r['flex_fwd']:.2f} | {r['flex_fwdbwd']:.2f} | "
                     f"{r['flex_tflops_fwdbwd']:.0f} | {r['ratio_fwdbwd']:.2f} | {r['ratio_fwd']:.2f} | {r.get('sdpa_padded_fwdbwd', float('nan')):.1f} |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(OUT, "summary.md"), "w") as f:
        f.write("\n".join(harness.markdown_stamp(stamp)) + f"\n\nbest config: {best}\n\n{text}\n")
    harness.write_json(os.path.join(OUT, "triton_tune.json"), harness.record(
        stamp, meta=vars(args), rows=rows, results=dict(best=str(best), log=LOG)))


if __name__ == "__main__":
    main()
