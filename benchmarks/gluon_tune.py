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

``--json PATH`` also writes the results as JSON, rewritten after every config
so that a run cut short keeps what it measured: per config its fields, its
``config_text``, whether it is the table's default, its ms and max relative
difference from Triton per input, and ``shapes_done`` (the inputs every config
went through). ``benchmarks/gluon_pick.py`` picks the winners from those files.

``parse_kernel_configs`` and ``use_kernel_configs`` read and apply
``benchmarks/attention.py``'s ``--gluon-configs "fwd: stages=3; dq: stages=3"``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dualkv_compile.kernels.gluon import attention as ga  # noqa: E402

KINDS = {"fwd": ga.FwdConfig, "dq": ga.DqConfig, "dkdv": ga.DkdvConfig}
TABLES = {"fwd": ga.FWD_CONFIGS, "dq": ga.DQ_CONFIGS, "dkdv": ga.DKDV_CONFIGS}
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
            want = type(getattr(cls, name))  # every field has a default: its type is the field's
            got = kwargs[name]
            if type(got) is not want and not (want is float and type(got) is int):
                raise ValueError(f"configs: {name}={got!r}: expected {want.__name__} for {cls.__name__}.{name}")
        configs.append(cls(**kwargs))
    return configs


def config_text(c) -> str:
    """``c`` as ``parse_configs`` reads it: the tile fields, then every other field off its class default."""
    tile = ("block_m", "block_n", "stages")
    return ", ".join(f"{f.name}={getattr(c, f.name)!r}" for f in dataclasses.fields(c)
                     if f.name in tile or getattr(c, f.name) != f.default)


def parse_kernel_configs(text: str) -> dict:
    """``{kind: config}`` of ``--gluon-configs`` text ("fwd: block_n=64, stages=3; dq: stages=3"), any subset of
    the kernels, each once; ValueError naming the option and what it expected."""
    opt = "--gluon-configs"
    form = "'kernel: field=value, ...' parts separated by ';'"
    configs = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        kind, sep, fields = part.partition(":")
        kind = kind.strip()
        if not sep:
            raise ValueError(f"{opt}: {part!r} names no kernel: expected {form}, kernel one of {sorted(KINDS)}")
        if kind not in KINDS:
            raise ValueError(f"{opt}: {kind!r} is not a kernel: expected one of {sorted(KINDS)} in {form}")
        if kind in configs:
            raise ValueError(f"{opt}: kernel {kind!r} is given twice: expected each kernel at most once")
        try:
            (configs[kind],) = parse_configs(kind, fields)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{opt}: {kind}: {e}") from None
    if not configs:
        raise ValueError(f"{opt}: no kernel in {text!r}: expected {form}, kernel one of {sorted(KINDS)}")
    return configs


def use_kernel_configs(text, head_dim: int) -> dict:
    """Put the configs of ``--gluon-configs`` text (None: none) into the tables of ``kernels/gluon/attention.py``
    at ``head_dim``, for this process; the record of what the kernels now run: ``{kind: config_text}``,
    ``"head_dim"`` and ``"set"``, the kernels ``text`` named."""
    configs = {} if text is None else parse_kernel_configs(text)
    if head_dim not in ga.FWD_CONFIGS:
        if configs:
            raise ValueError(f"--gluon-configs: head dim {head_dim} has no Gluon configs: "
                             f"expected --head-dim one of {sorted(ga.FWD_CONFIGS)}")
        return {}
    for kind, c in configs.items():
        TABLES[kind][head_dim] = c
    return dict({kind: config_text(TABLES[kind][head_dim]) for kind in KINDS}, head_dim=head_dim, set=sorted(configs))


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

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import attention as bench  # benchmarks/attention.py: the inputs
    from dualkv_compile.kernels.triton import attention as ta

    D = args.head_dim
    cfg = bench.Cfg(32 if D == 128 else 16, 8 if D == 128 else 4, D, torch.bfloat16, torch.device("cuda"))

    def bench_ms(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=300)

    default = TABLES[args.kind][D]
    record = dict(kind=args.kind, head_dim=D, heads=[cfg.hq, cfg.hkv], device=torch.cuda.get_device_name(),
                  torch=torch.__version__, triton=triton.__version__,
                  default=dict(text=config_text(default), fields=dataclasses.asdict(default)),
                  shapes_done=[], triton_ms={},
                  configs=[dict(text=config_text(c), fields=dataclasses.asdict(c), default=c == default,
                                ms={}, diff={}, errors={}) for c in configs])

    def save():
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(record, f, indent=1)
            os.replace(args.json + ".tmp", args.json)

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
