"""Time launch configs of the Gluon attention kernels against the Triton kernels, on an H100/H200.

    python benchmarks/tuning/gluon_tune.py fwd  "block_n=128; block_n=64, stages=3"
    python benchmarks/tuning/gluon_tune.py dq   "stages=4; stages=3" --head-dim 64
    python benchmarks/tuning/gluon_tune.py dkdv "dq_mode='recompute'; dq_mode='atomic'"

The first argument picks the kernel (``fwd``: ``FwdConfig``; ``dq``: ``DqConfig``;
``dkdv``: ``DkdvConfig``, all in ``kernels/gluon/attention.py``), the second
lists configs separated by ``;``, each as ``field=value`` pairs (Python
literals). For each of three inputs ((28, 16384, 1024), (8, 2048, 2048) and the
2-level tree of ``benchmarks/ops/attention.py``; bf16, Hq 32 / Hkv 8 at D 128,
16 / 4 at D 64) it prints the Triton kernels' time, then each config's time,
useful TFLOP/s (attention pairs x 4 x D x Hq, the backward 2.5x the forward)
and its relative difference from the Triton result (forward: out; backward:
dq, dk, dv). ``dq`` and ``dkdv`` time the whole backward with the other
kernel at its default; ``dq`` also prints the dQ pass's share (the backward
minus the Triton preprocess and dK/dV kernels'). Timing:
``triton.testing.do_bench`` (warm-up 50 ms, 300 ms). The runs and what they
found: ``benchmarks/results/gluon_tune/h200-2026-11-25-fwd/gluon_fwd_tuning_h200.md`` and
``benchmarks/results/gluon_tune/h200-2026-11-25-bwd/gluon_bwd_tuning_h200.md``.

``--json PATH`` also writes the results as JSON (a record of ``benchmarks/harness.py``, the sweep in its
``results``), rewritten after every config
so that a run cut short keeps what it measured: per config its fields, its
``config_text``, whether it is the table's default, its ms and max relative
difference from Triton per input, and ``shapes_done`` (the inputs every config
went through). ``benchmarks/tuning/gluon_pick.py`` picks the winners from those files.

The configs' text (``parse_configs``, ``parse_kernel_configs``, ``use_kernel_configs``: ``attention.py``'s
``--gluon-configs``) lives in ``benchmarks/ops/gluon_configs.py``, re-exported here.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks import harness  # noqa: E402
from benchmarks.ops.gluon_configs import (  # noqa: E402, F401  (re-exported: tests read them here)
    KINDS, TABLES, config_text, ga, parse_configs, parse_kernel_configs, use_kernel_configs,
)

SHAPES = [(28, 16384, 1024), (8, 2048, 2048), "tree"]


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("configs", help="field=value pairs, configs separated by ';'")
    ap.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    ap.add_argument("--json", default=None, help="also write the results here as JSON (after every config)")
    args = ap.parse_args(argv)
    try:
        configs = parse_configs(args.kind, args.configs)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        ap.error("needs an sm_90 GPU (H100, H200): the Gluon kernels run nowhere else")

    import triton
    from benchmarks.ops import attention as bench  # benchmarks/ops/attention.py: the inputs
    from dualkv_compile.kernels.triton import attention as ta

    D = args.head_dim
    cfg = bench.Cfg(32 if D == 128 else 16, 8 if D == 128 else 4, D, torch.bfloat16, torch.device("cuda"))

    def bench_ms(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=300)

    default = TABLES[args.kind][D]
    stamp = harness.stamp("gluon_tune", device="cuda", script=__file__, argv=argv)
    meta = dict(kind=args.kind, head_dim=D, heads=[cfg.hq, cfg.hkv], device=stamp["device"],
                torch=stamp["versions"]["torch"], triton=stamp["versions"]["triton"],
                default=dict(text=config_text(default), fields=dataclasses.asdict(default)))
    record = dict(kind=args.kind, shapes_done=[], triton_ms={},
                  configs=[dict(text=config_text(c), fields=dataclasses.asdict(c), default=c == default,
                                ms={}, diff={}, errors={}) for c in configs])

    def save():  # the harness's record, the sweep in its results (gluon_pick.py reads them there)
        if args.json:
            harness.write_json(args.json, harness.record(stamp, meta=meta, results=record))

    for shape in SHAPES:
        case = bench.tree_case() if shape == "tree" else bench.uniform_case(*shape)
        q, k, v = bench._packed(case, cfg)
        segs = bench.segments(case, cfg.device)
        flops = case.pairs_after * 4 * cfg.d * cfg.hq
        if args.kind == "fwd":
            ref, _ = ta.forward(q, k, v, segs, cfg.scale)
            ms = bench_ms(lambda: ta.forward(q, k, v, segs, cfg.scale))
            print(f"{case.name:36s} triton fwd {ms:8.3f} ms {flops / ms / 1e9:5.0f} TF/s", flush=True)
        else:
            flops *= 2.5
            do = torch.randn_like(q)
            out, lse = ga.forward(q, k, v, segs, cfg.scale)
            ref = ta.backward(do, q, k, v, out, lse, segs, cfg.scale)
            ms = bench_ms(lambda: ta.backward(do, q, k, v, out, lse, segs, cfg.scale))
            ms_dkdv = bench_ms(lambda: ta.backward_dkdv(do, q, k, v, out, lse, segs, cfg.scale))
            print(f"{case.name:36s} triton bwd {ms:8.3f} ms {flops / ms / 1e9:5.0f} TF/s "
                  f"(preprocess + dK/dV {ms_dkdv:.3f})", flush=True)
        record["triton_ms"][case.name] = ms
        for c, rec in zip(configs, record["configs"]):
            try:
                if args.kind == "fwd":
                    run = lambda: ga.forward(q, k, v, segs, cfg.scale, config=c)  # noqa: E731
                    diffs = [_rel(run()[0], ref)]
                else:
                    key = "config" if args.kind == "dq" else "dkdv_config"
                    run = lambda: ga.backward(do, q, k, v, out, lse, segs, cfg.scale, **{key: c})  # noqa: E731
                    diffs = [_rel(g, r) for g, r in zip(run(), ref)]
                diff = " ".join(f"{d:.1e}" for d in diffs)
                rec["diff"][case.name] = max(diffs) if all(math.isfinite(d) for d in diffs) else None  # None: NaN/inf
                ms = bench_ms(run)
                rec["ms"][case.name] = ms
                share = f" (dQ pass {ms - ms_dkdv:.3f})" if args.kind == "dq" else ""
                print(f"{case.name:36s} {c} {ms:8.3f} ms {flops / ms / 1e9:5.0f} TF/s{share} diff vs triton {diff}",
                      flush=True)
            except Exception as e:  # a config that does not compile or fit is reported, and the sweep goes on
                rec["errors"][case.name] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{case.name:36s} {c} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            save()
        record["shapes_done"].append(case.name)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
