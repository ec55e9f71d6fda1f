"""Time launch configs of the Gluon attention kernels against the Triton kernels, on an H100/H200.

    python benchmarks/gluon_tune.py fwd  "block_n=128; block_n=64, stages=3"
    python benchmarks/gluon_tune.py dq   "stages=4; stages=3" --head-dim 64
    python benchmarks/gluon_tune.py dkdv "dq_mode='recompute'; dq_mode='atomic'"

The first argument picks the kernel (``fwd``: ``FwdConfig``; ``dq``: ``DqConfig``;
``dkdv``: ``DkdvConfig``, all in ``kernels/gluon/attention.py``), the second
lists configs separated by ``;``, each as ``field=value`` pairs (Python
literals). For each of three inputs ((28, 16384, 1024), (8, 2048, 2048) and the
2-level tree of ``benchmarks/attention.py``; bf16, Hq 32 / Hkv 8 at D 128,
16 / 4 at D 64) it prints the Triton kernels' time, then each config's time,
useful TFLOP/s (attention pairs x 4 x D x Hq, the backward 2.5x the forward)
and its relative difference from the Triton result (forward: out; backward:
dq, dk, dv). ``dq`` and ``dkdv`` time the whole backward with the other
kernel at its default; ``dq`` also prints the dQ pass's share (the backward
minus the Triton preprocess and dK/dV kernels'). Timing:
``triton.testing.do_bench`` (warm-up 50 ms, 300 ms). The runs and what they
found: ``benchmarks/results/gluon_fwd_tuning_h200.md`` and
``gluon_bwd_tuning_h200.md``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dualkv_compile.kernels.gluon import attention as ga  # noqa: E402

KINDS = {"fwd": ga.FwdConfig, "dq": ga.DqConfig, "dkdv": ga.DkdvConfig}
SHAPES = [(28, 16384, 1024), (8, 2048, 2048), "tree"]


def parse_configs(kind: str, text: str) -> list:
    """The configs of ``text`` ("a=1, b='x'; a=2"), each a ``KINDS[kind]``; ValueError naming what is wrong."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {sorted(KINDS)}, got {kind!r}")
    cls = KINDS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    configs = []
    for part in (p.strip() for p in text.split(";")):
        kwargs = {}
        for item in (i.strip() for i in part.split(",") if i.strip()):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in names:
                raise ValueError(f"configs: {item!r} is not field=value with a field of {cls.__name__} ({sorted(names)})")
            try:
                kwargs[name] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                raise ValueError(f"configs: the value of {name!r} is not a Python literal: {value.strip()!r}") from None
        configs.append(cls(**kwargs))
    return configs


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("configs", help="field=value pairs, configs separated by ';'")
    ap.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    args = ap.parse_args(argv)
    try:
        configs = parse_configs(args.kind, args.configs)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        ap.error("needs an sm_90 GPU (H100, H200): the Gluon kernels run nowhere else")

    import triton

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import attention as bench  # benchmarks/attention.py: the inputs
    from dualkv_compile.kernels.triton import attention as ta

    D = args.head_dim
    cfg = bench.Cfg(32 if D == 128 else 16, 8 if D == 128 else 4, D, torch.bfloat16, torch.device("cuda"))

    def bench_ms(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=300)

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
        for c in configs:
            try:
                if args.kind == "fwd":
                    run = lambda: ga.forward(q, k, v, segs, cfg.scale, config=c)  # noqa: E731
                    diff = f"{_rel(run()[0], ref):.1e}"
                else:
                    key = "config" if args.kind == "dq" else "dkdv_config"
                    run = lambda: ga.backward(do, q, k, v, out, lse, segs, cfg.scale, **{key: c})  # noqa: E731
                    diff = " ".join(f"{_rel(g, r):.1e}" for g, r in zip(run(), ref))
                ms = bench_ms(run)
                share = f" (dQ pass {ms - ms_dkdv:.3f})" if args.kind == "dq" else ""
                print(f"{case.name:36s} {c} {ms:8.3f} ms {flops / ms / 1e9:5.0f} TF/s{share} diff vs triton {diff}",
                      flush=True)
            except Exception as e:  # a config that does not compile or fit is reported, and the sweep goes on
                print(f"{case.name:36s} {c} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
