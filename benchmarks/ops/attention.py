"""Shared-prompt attention, side by side: duplicated-batch SDPA vs packed-stream kernels.

One process times, for each (N, P, R) case, forward and forward+backward of:

    sdpa_flash_dup   SDPA (flash backend), the duplicated [N, P+R] batch, causal
    sdpa_cudnn_dup   SDPA (cuDNN backend), the duplicated batch, causal
    varlen_dup       the duplicated rows back to back in one varlen call (the strongest baseline's attention:
                     torch's varlen_attn or FlashAttention-4: DUALKV_VARLEN_KERNEL), no padding computed
    flex_packed      FlexAttention on the packed stream, compiled, two-region
                     BlockMask built once outside the timed region
    flex_user        plain FlexAttention as a user writes it: create_block_mask of a
                     mask_mod over document ids and an ancestor table, defaults,
                     torch.compile(flex_attention), no kernel options
    split_sdpa       prompt causal SDPA + every response over [prompt K/V, own K/V]
                     with a lower-right causal bias (the PrefixGrouper approach)
    dualkv_flex      shared_prompt_attention(backend="flex") (BlockMask built per call)
    dualkv_flex_op   the opaque custom op dualkv::attention_fwd with backend="flex"
                     (its backward recomputes the forward; shows why the op
                     routes flex around the opaque op)
    dualkv_triton    shared_prompt_attention(backend="triton"), when available

Reported per method: median ms (CUDA events; each call queued behind a short GPU
sleep so the host's dispatch overlaps the GPU, and again from an idle GPU: see
``time_ms``), useful TFLOP/s (attention pairs
of the packed layout x 4 x D x Hq; backward counted 2.5x the forward, so
fwd+bwd is 3.5x), peak memory, and per case the ideal ratio (attention pairs of
the duplicated batch over those of the packed stream). A method that runs out
of memory is reported as OOM. The block-mask build time at T = 64K and the
compile count of the flex path across layouts are measured first.

    python benchmarks/ops/attention.py                 # full run on CUDA
    python benchmarks/ops/attention.py --quick         # smoke test on CUDA
    python benchmarks/ops/attention.py --device cpu --quick   # reference path on tiny shapes
    python benchmarks/ops/attention.py --shapes 16,4096,1024 --shapes groups
    python benchmarks/ops/attention.py --shapes tree   # system 4K shared by 4 groups of a 2K prompt and 8 responses of 1K
    python benchmarks/ops/attention.py --head-dim 64 --gluon-configs "fwd: block_n=64, stages=3; dq: stages=3"

``--gluon-configs`` replaces, in this process, the launch configs of the named Gluon kernels (``fwd``, ``dq``,
``dkdv``; fields as ``benchmarks/tuning/gluon_tune.py`` reads them) at ``--head-dim``; the report's meta records the
configs the Gluon kernels ran with (on CUDA always).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from benchmarks import harness  # noqa: E402
from dualkv_compile.ops import attention as dk_op  # noqa: E402

# The cases, methods, timing and report live in sibling modules; their names stay reachable as
# ``attention.<name>`` (op_overhead.py, gluon_tune.py, the tuning scripts and tests/test_benchmarks.py use them).
from benchmarks.ops.attention_methods import (  # noqa: E402, F401
    _TRITON_IMPORT_ERROR, Case, Cfg, _dup_inputs, _packed, _randn, groups_case, methods_for, segments, setup_dualkv,
    setup_dualkv_flex_op, setup_flex_packed, setup_sdpa_dup, setup_split_sdpa, tree_case, triton_attention,
    triton_skip_reason, uniform_case,
)
from benchmarks.ops.attention_report import _slug, markdown, plot, write_report  # noqa: E402, F401
from benchmarks.ops.attention_timing import QUEUE_MS, _free, _null, _sync, gpu_sleep, log, time_ms  # noqa: E402, F401

# Cheapest first, so that a run cut short still reports most cases (results are written after each).
FULL_SHAPES = [(8, 2048, 2048), (16, 4096, 1024), (28, 4096, 2048), (28, 16384, 1024), (16, 32768, 1024), (16, 32768, 2048)]
QUICK_SHAPES = [(4, 1024, 256), (3, 700, 333)]
CPU_SHAPES = [(3, 64, 32), (2, 50, 17)]


def run_method(name, setup, case: Case, cfg: Cfg, args) -> list[dict]:
    rows = []
    device = cfg.device
    flops_fwd = case.pairs_after * 4 * cfg.d * cfg.hq
    if device.type == "cuda":
        _free()
        torch.cuda.reset_peak_memory_stats()
    base = dict(method=name, **case.summary())
    try:
        t0 = time.time()
        fn, leaves, douts, note = setup(case, cfg)
        with torch.no_grad():
            fwd_ms, fwd_idle = time_ms(fn, device, args.budget_ms, args.min_reps, args.max_reps)
        peak_fwd = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        outs = fn()
        douts = [torch.randn_like(o) for o in outs]
        del outs

        def fwd_bwd():
            o = fn()
            return torch.autograd.grad(o, leaves, douts)

        bwd_ms, bwd_idle = time_ms(fwd_bwd, device, args.budget_ms, args.min_reps, args.max_reps)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        for mode, ms, ms_idle, mult, pk in (("fwd", fwd_ms, fwd_idle, 1.0, peak_fwd),
                                            ("fwd+bwd", bwd_ms, bwd_idle, 3.5, peak)):
            rows.append(dict(base, mode=mode, status="ok", ms=round(ms, 3),
                             ms_idle=round(ms_idle, 3) if device.type == "cuda" else None,
                             tflops=float(f"{flops_fwd * mult / ms / 1e9:.4g}"),
                             peak_gb=None if pk is None else round(pk, 2), note=note))
        log(f"  {name:15s} fwd {fwd_ms:9.2f} ms  fwd+bwd {bwd_ms:9.2f} ms  peak {peak or 0:.1f} GB  ({time.time() - t0:.0f}s) {note}")
    except torch.OutOfMemoryError:
        log(f"  {name:15s} OOM")
        rows = [dict(base, mode=m, status="OOM", ms=None, ms_idle=None, tflops=None, peak_gb=None, note="")
                for m in ("fwd", "fwd+bwd")]
    except Exception as e:  # noqa: BLE001 - a failing method must not end the run
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        log(f"  {name:15s} FAILED {msg}")
        rows = [dict(base, mode=m, status="error", ms=None, ms_idle=None, tflops=None, peak_gb=None, note=msg)
                for m in ("fwd", "fwd+bwd")]
    finally:
        fn = leaves = douts = None  # noqa: F841
        _free()
    return rows


# --------------------------------------------------------------------------- block mask


def measure_block_mask(cfg: Cfg, T_target: int = 65536, reps: int = 50, res: Optional[dict] = None) -> dict:
    """Build time of the two-region BlockMask at T = 64K, sync check, and compile count across layouts."""
    from torch._dynamo.utils import counters

    from dualkv_compile.ops import flex

    res = {} if res is None else res  # filled as it goes: a failure keeps what was measured
    res["T"] = T_target
    case = Case("mask", [(32768, [2048] * 16)])
    assert case.num_tokens == T_target
    segs = segments(case, cfg.device)
    for builder in ("torch", "op"):
        key = "triton op" if builder == "op" else "eager torch ops"
        t0 = time.time()
        flex.block_mask(segs, T_target, builder=builder)
        torch.cuda.synchronize()
        first = time.time() - t0
        host, total = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            flex.block_mask(segs, T_target, builder=builder)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append((t1 - t0) * 1e3)
            total.append((t2 - t0) * 1e3)
        # device time alone, with events
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            flex.block_mask(segs, T_target, builder=builder)
        e.record()
        e.synchronize()
        res[key] = dict(first_call_s=round(first, 2), host_ms_median=round(statistics.median(host), 4),
                        host_plus_device_ms_median=round(statistics.median(total), 4),
                        back_to_back_ms_per_build=round(s.elapsed_time(e) / reps, 4))
        log(f"  block mask ({key}): {res[key]}")
    torch.cuda.set_sync_debug_mode("error")
    try:
        flex.block_mask(segs, T_target, builder="torch")
        flex.block_mask(segs, T_target)
        res["syncs"] = "none (torch.cuda.set_sync_debug_mode('error') raised nothing)"
    except RuntimeError as e:
        res["syncs"] = f"SYNC: {e}"
    finally:
        torch.cuda.set_sync_debug_mode("default")

    # Compile count of the flex path (builder + flex fwd/bwd) across layouts near 64K.
    layouts = [
        Case("a", [(32768, [2048] * 16)]),
        Case("b", [(16384, [1024] * 28)]),
        Case("c", [(30000, [1999] * 17)]),
        groups_case(4, 8, 4096, 128, 2048, seed=1),
        Case("e", [(8191, [129] * 3), (20000, [3000, 1, 77]), (5, [])]),
    ]

    def fwd_bwd(c: Case):
        q, k, v = _packed(c, cfg)
        out = dk_op.shared_prompt_attention(q, k, v, segments(c, cfg.device), scale=cfg.scale, backend="flex")
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        torch.cuda.synchronize()

    g0 = counters["stats"]["unique_graphs"]
    fwd_bwd(layouts[0])
    g1 = counters["stats"]["unique_graphs"]
    for c in layouts[1:]:
        fwd_bwd(c)
    g2 = counters["stats"]["unique_graphs"]
    res["compiles_first_layout"] = g1 - g0
    res["recompiles_next_layouts"] = g2 - g1
    res["layouts_T"] = [c.num_tokens for c in layouts]
    log(f"  flex path graphs: first layout {g1 - g0}, {len(layouts) - 1} more layouts {g2 - g1} (T = {res['layouts_T']})")
    _free()
    return res


# --------------------------------------------------------------------------- main


def case_for(shape, device: torch.device, quick: bool = False) -> Case:
    """The case of a ``parse_shape`` value: (N, P, R), or the named "groups" and "tree" cases, full-size on CUDA
    (small ones for ``quick`` runs and tiny ones on CPU)."""
    full, cpu = device.type == "cuda" and not quick, device.type == "cpu"
    if shape == "groups":
        return (groups_case(4, 8, 4096, 128, 2048, seed=0) if full
                else groups_case(2, 3, 48 if cpu else 512, 8 if cpu else 64, 40 if cpu else 300, seed=0))
    if shape == "tree":
        return tree_case() if full else tree_case(40, 2, 3, 24, 16) if cpu else tree_case(512, 2, 4, 256, 128)
    return uniform_case(*shape)


def parse_shape(s: str):
    if s in ("groups", "tree"):
        return s
    n, p, r = (int(x) for x in s.split(","))
    return (n, p, r)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="small shapes, few reps (smoke test)")
    ap.add_argument("--shapes", action="append", type=parse_shape, help="N,P,R, 'groups' or 'tree'; repeatable (default: all)")
    ap.add_argument("--methods", default=None, help="comma-separated subset of methods")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: benchmarks/results/attention/<device>-<date>/ (benchmarks/harness.py)")
    ap.add_argument("--stem", default=None, help="output file stem (default attention_<device>[_quick])")
    ap.add_argument("--budget-ms", type=float, default=400.0, help="time budget per measurement after warm-up")
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--max-reps", type=int, default=30)
    ap.add_argument("--skip-mask", action="store_true", help="skip the block-mask measurements")
    ap.add_argument("--head-dim", type=int, default=128, help="CUDA: D (Qwen3's 128; Llama-3.2-1B's 64)")
    ap.add_argument("--heads", default="32,8", help="CUDA: Hq,Hkv")
    ap.add_argument("--plot-only", type=Path, default=None, help="redraw the PNG and Markdown from a results JSON")
    ap.add_argument("--gluon-configs", default=None,
                    help="'kernel: field=value, ...; ...' (kernels fwd, dq, dkdv): the Gluon launch configs at --head-dim")
    args = ap.parse_args(argv)

    if args.plot_only:
        results = harness.payload(json.loads(args.plot_only.read_text()))
        stem = args.plot_only.with_suffix("")
        stem.with_suffix(".md").write_text(markdown(results))
        plot(results, stem.with_suffix(".png"))
        return 0

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    gluon_configs = None
    if args.gluon_configs is not None or device.type == "cuda":
        from benchmarks.ops.gluon_configs import use_kernel_configs

        try:
            gluon_configs = use_kernel_configs(args.gluon_configs, args.head_dim)
        except ValueError as e:
            ap.error(str(e))
    if device.type == "cpu":
        cfg = Cfg(4, 2, 16, torch.float32, device)
        shapes = args.shapes or CPU_SHAPES + ["groups", "tree"]
        args.budget_ms, args.max_reps, args.skip_mask = min(args.budget_ms, 50.0), min(args.max_reps, 5), True
    else:
        hq, hkv = (int(h) for h in args.heads.split(","))
        cfg = Cfg(hq, hkv, args.head_dim, torch.bfloat16, device)
        shapes = args.shapes or (QUICK_SHAPES + ["groups", "tree"] if args.quick else FULL_SHAPES[:4] + ["groups", "tree"] + FULL_SHAPES[4:])
        if args.quick:
            args.budget_ms, args.max_reps = min(args.budget_ms, 50.0), min(args.max_reps, 5)

    cases = [case_for(s, device, args.quick) for s in shapes]

    methods = methods_for(cfg)
    skipped = {}
    if device.type == "cuda":
        for backend in ("triton", "gluon"):
            why = triton_skip_reason(cfg, backend)
            if why is not None:
                skipped[f"dualkv_{backend}"] = why
                methods.pop(f"dualkv_{backend}", None)
    if args.methods:
        keep = set(args.methods.split(","))
        methods = {k: v for k, v in methods.items() if k in keep}

    stamp = harness.stamp("attention", device=device, script=__file__, argv=argv)
    args.out = args.out or Path(harness.result_dir(stamp))
    versions = stamp["versions"]
    meta = dict(
        device=stamp["device"], torch=versions["torch"], triton=versions["triton"], cuda=versions["cuda"],
        date=stamp["date"],
        hq=cfg.hq, hkv=cfg.hkv, d=cfg.d, dtype=str(cfg.dtype).replace("torch.", ""),
        cuda_timing=device.type == "cuda", quick=args.quick, budget_ms=args.budget_ms, min_reps=args.min_reps, max_reps=args.max_reps,
    )
    if gluon_configs:
        meta["gluon_configs"] = gluon_configs
    log(f"{meta['device']} torch {meta['torch']} triton {meta['triton']}; methods {list(methods)}; skipped {skipped}")
    results = dict(meta=meta, cases=[c.summary() for c in cases], rows=[], skipped=skipped)
    stem = args.stem or ("attention_" + ("cpu" if device.type == "cpu" else _slug(meta["device"])) + ("_quick" if args.quick else "")
                         + (f"_d{cfg.d}" if device.type == "cuda" and cfg.d != 128 else ""))

    torch.manual_seed(0)
    if device.type == "cuda" and not args.skip_mask:
        log("block mask at T=64K")
        results["block_mask"] = {}
        try:
            measure_block_mask(cfg, res=results["block_mask"])
        except Exception as e:  # noqa: BLE001
            results["block_mask"]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"  block mask FAILED: {e}")
            torch.cuda.set_sync_debug_mode("default")
        write_report(results, args.out, stem, stamp)

    t_start = time.time()
    for case in cases:
        log(f"case {case.name}: T={case.num_tokens} rows={len(case.rows)} ideal ratio {case.ideal_ratio:.2f}x")
        for name, setup in methods.items():
            results["rows"] += run_method(name, setup, case, cfg, args)
        write_report(results, args.out, stem, stamp)  # after every case: a killed run keeps what it measured
    log(f"done in {time.time() - t_start:.0f}s; wrote {args.out}/{stem}.{{json,md,png}}")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
