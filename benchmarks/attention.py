"""Shared-prompt attention, side by side: duplicated-batch SDPA vs packed-stream kernels.

One process times, for each (N, P, R) case, forward and forward+backward of:

    sdpa_flash_dup   SDPA (flash backend), the duplicated [N, P+R] batch, causal
    sdpa_cudnn_dup   SDPA (cuDNN backend), the duplicated batch, causal
    flex_packed      FlexAttention on the packed stream, compiled, two-region
                     BlockMask built once outside the timed region
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

    python benchmarks/attention.py                 # full run on CUDA
    python benchmarks/attention.py --quick         # smoke test on CUDA
    python benchmarks/attention.py --device cpu --quick   # reference path on tiny shapes
    python benchmarks/attention.py --shapes 16,4096,1024 --shapes groups
    python benchmarks/attention.py --shapes tree   # system 4K shared by 4 groups of a 2K prompt and 8 responses of 1K
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dualkv_compile.ops import attention as dk_op  # noqa: E402
from dualkv_compile.layout.segments import Segments, tree_segments  # noqa: E402

try:  # written by another helper; the benchmark runs with or without it
    from dualkv_compile.kernels.triton import attention as triton_attention
except Exception as e:  # noqa: BLE001
    triton_attention = None
    _TRITON_IMPORT_ERROR = f"{type(e).__name__}: {e}"
else:
    _TRITON_IMPORT_ERROR = None

# Cheapest first, so that a run cut short still reports most cases (results are written after each).
FULL_SHAPES = [(8, 2048, 2048), (16, 4096, 1024), (28, 4096, 2048), (28, 16384, 1024), (16, 32768, 1024), (16, 32768, 2048)]
QUICK_SHAPES = [(4, 1024, 256), (3, 700, 333)]
CPU_SHAPES = [(3, 64, 32), (2, 50, 17)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass
class Case:
    name: str
    groups: list  # [(P, [R_0, R_1, ...]), ...]
    system: int = 0  # a system prompt shared by every group: a tree of two levels above the responses

    @property
    def num_tokens(self) -> int:
        return self.system + sum(P + sum(Rs) for P, Rs in self.groups)

    @property
    def rows(self) -> list[int]:
        return [self.system + P + R for P, Rs in self.groups for R in Rs]

    @property
    def pairs_before(self) -> int:
        return sum(n * (n + 1) // 2 for n in self.rows)

    @property
    def pairs_after(self) -> int:
        Y = self.system
        return Y * (Y + 1) // 2 + sum(
            Y * P + P * (P + 1) // 2 + sum((Y + P) * R + R * (R + 1) // 2 for R in Rs) for P, Rs in self.groups
        )

    @property
    def ideal_ratio(self) -> float:
        return self.pairs_before / self.pairs_after

    def summary(self) -> dict:
        Ps = sorted({P for P, _ in self.groups})
        Rs = [R for _, rs in self.groups for R in rs]
        return dict(
            case=self.name,
            system=self.system,
            groups=len(self.groups),
            N=len(Rs),
            P=Ps[0] if len(Ps) == 1 else Ps,
            R=Rs[0] if len(set(Rs)) == 1 else f"{min(Rs)}..{max(Rs)}",
            T=self.num_tokens,
            pairs_before=self.pairs_before,
            pairs_after=self.pairs_after,
            ideal_ratio=round(self.ideal_ratio, 3),
        )


def uniform_case(N: int, P: int, R: int) -> Case:
    return Case(f"N{N}_P{P}_R{R}", [(P, [R] * N)])


def groups_case(num_groups=4, N=8, P=4096, lo=128, hi=2048, seed=0) -> Case:
    rng = random.Random(seed)
    return Case(f"groups{num_groups}_N{N}_P{P}_R{lo}-{hi}", [(P, [rng.randint(lo, hi) for _ in range(N)]) for _ in range(num_groups)])


def tree_case(system=4096, num_groups=4, N=8, P=2048, R=1024) -> Case:
    """A system prompt shared by ``num_groups`` groups of a ``P``-token prompt and ``N`` responses of ``R``."""
    return Case(f"tree_sys{system}_{num_groups}x(P{P}_N{N}_R{R})", [(P, [R] * N) for _ in range(num_groups)], system)


def segments(case: Case, device) -> Segments:
    # The system prompt (if any) a root, each group's prompt its child (or a root), the responses
    # the prompt's children: pre-order.
    lens, parents = [], []
    root = -1
    if case.system:
        lens.append(case.system)
        parents.append(-1)
        root = 0
    for P, Rs in case.groups:
        prompt = len(lens)
        lens.append(P)
        parents.append(root)
        lens.extend(Rs)
        parents.extend([prompt] * len(Rs))
    return tree_segments(lens, parents, device)


# --------------------------------------------------------------------------- methods
# Each setup returns (fn, leaves, douts, note): fn() -> list of outputs; leaves
# are the tensors the backward differentiates; douts match fn's outputs.


@dataclasses.dataclass
class Cfg:
    hq: int
    hkv: int
    d: int
    dtype: torch.dtype
    device: torch.device

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d)


def _randn(cfg: Cfg, *shape) -> torch.Tensor:
    return torch.randn(*shape, device=cfg.device, dtype=cfg.dtype)


def _packed(case: Case, cfg: Cfg):
    T = case.num_tokens
    return [_randn(cfg, 1, h, T, cfg.d).requires_grad_() for h in (cfg.hq, cfg.hkv, cfg.hkv)]


def _dup_inputs(case: Case, cfg: Cfg, kv_heads: int):
    """The duplicated batch: one row per response, right-padded to the longest row."""
    B, S = len(case.rows), max(case.rows)
    q = _randn(cfg, B, cfg.hq, S, cfg.d).requires_grad_()
    k = _randn(cfg, B, kv_heads, S, cfg.d).requires_grad_()
    v = _randn(cfg, B, kv_heads, S, cfg.d).requires_grad_()
    return q, k, v


def setup_sdpa_dup(case: Case, cfg: Cfg, backend: Optional[str]):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    note = ""
    for expand in (False, True):
        q, k, v = _dup_inputs(case, cfg, cfg.hq if expand else cfg.hkv)

        def fn(q=q, k=k, v=v, expand=expand):
            ctx = sdpa_kernel(kinds[backend]) if backend else _null()
            with ctx:
                return [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.scale, enable_gqa=not expand)]

        try:
            with torch.no_grad():
                fn()
            break
        except RuntimeError as e:
            if expand or "out of memory" in str(e):
                raise
            note = f"GQA refused ({str(e).splitlines()[0][:80]}); K/V materialised with Hq heads"
            q = k = v = fn = None  # fn's defaults hold the tensors too
            _free()
    return fn, [q, k, v], None, note


def setup_split_sdpa(case: Case, cfg: Cfg):
    """Prompt causal, then each group's responses (right-padded) over [prompt K/V, own K/V], lower-right causal."""
    from torch.nn.attention.bias import causal_lower_right

    if case.system:
        raise NotImplementedError("split_sdpa (PrefixGrouper's two regions) has no tree: one prompt per group only")

    leaves, parts = [], []
    for P, Rs in case.groups:
        Rmax = max(Rs)
        qp, kp, vp = (_randn(cfg, 1, h, P, cfg.d).requires_grad_() for h in (cfg.hq, cfg.hkv, cfg.hkv))
        qr = _randn(cfg, len(Rs), cfg.hq, Rmax, cfg.d).requires_grad_()
        kr, vr = (_randn(cfg, len(Rs), cfg.hkv, Rmax, cfg.d).requires_grad_() for _ in range(2))
        leaves += [qp, kp, vp, qr, kr, vr]
        parts.append((P, Rmax, qp, kp, vp, qr, kr, vr))
    state = {"expand": False}

    def fn():
        outs = []
        for P, Rmax, qp, kp, vp, qr, kr, vr in parts:
            outs.append(F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=cfg.scale, enable_gqa=True))
            n = qr.shape[0]
            k = torch.cat([kp.expand(n, -1, -1, -1), kr], dim=2)
            v = torch.cat([vp.expand(n, -1, -1, -1), vr], dim=2)
            if state["expand"]:
                g = cfg.hq // cfg.hkv
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            bias = causal_lower_right(Rmax, P + Rmax)
            outs.append(F.scaled_dot_product_attention(qr, k, v, attn_mask=bias, scale=cfg.scale, enable_gqa=not state["expand"]))
        return outs

    note = ""
    try:
        with torch.no_grad():
            fn()
    except RuntimeError as e:
        if "out of memory" in str(e):
            raise
        state["expand"] = True
        note = f"GQA refused with the lower-right bias ({str(e).splitlines()[0][:80]}); K/V expanded per call"
    return fn, leaves, None, note


def setup_flex_packed(case: Case, cfg: Cfg):
    from dualkv_compile.ops import flex

    q, k, v = _packed(case, cfg)
    segs = segments(case, cfg.device)
    bm = flex.block_mask(segs, case.num_tokens)
    compiled = flex.compiled_flex()

    def fn():
        return [compiled(q, k, v, block_mask=bm, scale=cfg.scale, enable_gqa=cfg.hq != cfg.hkv)]

    return fn, [q, k, v], None, "BlockMask prebuilt (outside timing)"


def setup_dualkv(case: Case, cfg: Cfg, backend: str):
    q, k, v = _packed(case, cfg)
    segs = segments(case, cfg.device)

    def fn():
        return [dk_op.shared_prompt_attention(q, k, v, segs, scale=cfg.scale, backend=backend)]

    return fn, [q, k, v], None, ""


def setup_dualkv_flex_op(case: Case, cfg: Cfg):
    q, k, v = _packed(case, cfg)
    segs = segments(case, cfg.device)

    def fn():
        return [dk_op.attention_fwd(q, k, v, *segs, cfg.scale, 0.0, "flex")[0]]

    return fn, [q, k, v], None, "opaque custom op; backward recomputes the forward"


def methods_for(cfg: Cfg) -> dict[str, Callable]:
    if cfg.device.type == "cpu":
        return {
            "sdpa_dup": lambda c, g: setup_sdpa_dup(c, g, None),
            "split_sdpa": setup_split_sdpa,
            "dualkv_reference": lambda c, g: setup_dualkv(c, g, "reference"),
        }
    m = {
        "sdpa_flash_dup": lambda c, g: setup_sdpa_dup(c, g, "flash"),
        "sdpa_cudnn_dup": lambda c, g: setup_sdpa_dup(c, g, "cudnn"),
        "flex_packed": setup_flex_packed,
        "split_sdpa": setup_split_sdpa,
        "dualkv_flex": lambda c, g: setup_dualkv(c, g, "flex"),
        "dualkv_flex_op": setup_dualkv_flex_op,
    }
    if triton_attention is not None:
        m["dualkv_triton"] = lambda c, g: setup_dualkv(c, g, "triton")
        m["dualkv_gluon"] = lambda c, g: setup_dualkv(c, g, "gluon")
    return m


def triton_skip_reason(cfg: Cfg, backend: str = "triton") -> Optional[str]:
    if triton_attention is None:
        return f"dualkv_compile.kernels.triton.attention not importable ({_TRITON_IMPORT_ERROR})"
    probe = torch.empty(1, cfg.hq, 256, cfg.d, device=cfg.device, dtype=cfg.dtype)
    return dk_op.unsupported_reason(backend, probe)


# --------------------------------------------------------------------------- timing


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


QUEUE_MS = 2.0  # the GPU sleep each timed call is queued behind (see time_ms)


def gpu_sleep(ms: float) -> None:
    """Queue about ``ms`` of GPU sleep on the current stream, so the host's next launches find the GPU busy."""
    torch.cuda._sleep(int(ms * 1.5e6))  # clock cycles, at about 1.5 GHz: the length need not be exact


def time_ms(fn: Callable, device, budget_ms: float, min_reps: int, max_reps: int) -> tuple[float, float]:
    """``(queued, from_idle)``: median ms of ``fn`` after one warm-up call; reps fitted to the budget.

    On CUDA each rep times ``fn`` twice, with events around it: ``queued`` behind a ``QUEUE_MS`` GPU
    sleep, so the host's work before the first kernel (Python dispatch, checks, launches) runs while
    the GPU is busy, as in a training step whose host runs ahead; ``from_idle`` from an idle GPU, so
    that host work counts (``benchmarks/op_overhead.py`` splits it out). On CPU both are wall time.
    """
    fn()
    _sync(device)
    queued, idle = [], []
    while True:
        if device.type == "cuda":
            for times, ahead in ((queued, True), (idle, False)):
                if ahead:
                    gpu_sleep(QUEUE_MS)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            queued.append((time.perf_counter() - t0) * 1e3)
            idle.append(queued[-1])
        n = len(queued)
        if n >= max_reps or (n >= min_reps and sum(queued) >= budget_ms):
            return statistics.median(queued), statistics.median(idle)


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


# --------------------------------------------------------------------------- report


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s.lower()).strip("_")


def write_report(results: dict, out_dir: Path, stem: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out_dir / f"{stem}.md").write_text(markdown(results))
    try:
        plot(results, out_dir / f"{stem}.png")
    except Exception as e:  # noqa: BLE001 - matplotlib may be missing
        log(f"no plot: {type(e).__name__}: {e}")


def markdown(results: dict) -> str:
    m = results["meta"]
    lines = [
        "# Shared-prompt attention: side by side",
        "",
        f"- device: {m['device']}; torch {m['torch']}; triton {m['triton']}; CUDA {m['cuda']}; date {m['date']}",
        f"- Hq={m['hq']}, Hkv={m['hkv']}, D={m['d']}, {m['dtype']}; median of {'CUDA-event' if m['cuda_timing'] else 'wall-clock'} timings; "
        "TFLOP/s = useful attention pairs (packed layout) x 4 x D x Hq / time, fwd+bwd counted 3.5x",
        *(["- ms: each call queued behind a short GPU sleep, so the host's work before its first kernel overlaps "
           "the GPU (as in a training step, whose host runs ahead); 'from idle': the same calls started on an idle "
           "GPU, the host's dispatch and launch counted (benchmarks/op_overhead.py gives each method's host share)"]
          if m["cuda_timing"] else []),
        *([f"- **Caveat:** {m['caveat']}"] if m.get("caveat") else []),
        "- speedup: SDPA (flash on CUDA) on the duplicated batch, fwd+bwd time, over the method's; "
        "peak GB: peak allocated memory of the method (its inputs, activations and gradients)",
        "- vs cuDNN: fwd+bwd efficiency against SDPA-cuDNN's (its time on the duplicated batch over the method's time "
        "times the ideal ratio: the method's useful TFLOP/s over cuDNN's own TFLOP/s); 1 is cuDNN's efficiency",
        "",
    ]
    bm = results.get("block_mask")
    if bm:
        lines += [f"## Block mask (T = {bm.get('T', '?')})", ""]
        for key in bm:
            if key.startswith(("eager", "triton")):
                lines.append(f"- {key} builder (ms): {bm[key]}")
        for key in ("syncs", "compiles_first_layout", "recompiles_next_layouts", "layouts_T", "error"):
            if key in bm:
                lines.append(f"- {key}: {bm[key]}")
        lines.append("")
    notes = {}
    for case in results["cases"]:
        rows = [r for r in results["rows"] if r["case"] == case["case"]]
        base = next((r["ms"] for r in rows if r["method"] in ("sdpa_flash_dup", "sdpa_dup") and r["mode"] == "fwd+bwd" and r["ms"]), None)
        cudnn_row = next((r for r in rows
                          if r["method"] == "sdpa_cudnn_dup" and r["mode"] == "fwd+bwd" and r["ms"]), {})
        cudnn, cudnn_idle = cudnn_row.get("ms"), cudnn_row.get("ms_idle")
        lines += [
            f"## {case['case']}: N={case['N']}, P={case['P']}, R={case['R']}, T={case['T']}, ideal ratio {case['ideal_ratio']}x",
            "",
            "| method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | speedup (fwd+bwd) | vs cuDNN | peak GB "
            "| fwd+bwd ms from idle | vs cuDNN from idle |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for meth in dict.fromkeys(r["method"] for r in rows):
            f = next(r for r in rows if r["method"] == meth and r["mode"] == "fwd")
            b = next(r for r in rows if r["method"] == meth and r["mode"] == "fwd+bwd")
            if b["note"]:
                notes.setdefault(meth, set()).add(b["note"])
            if b["status"] != "ok":
                lines.append(f"| {meth} | {b['status']} | | {b['status']} | | | | | | |")
                continue
            sp = f"{base / b['ms']:.2f}x" if base else ""
            eff = f"{cudnn / (b['ms'] * case['ideal_ratio']):.3f}" if cudnn and meth != "sdpa_cudnn_dup" else ""
            pk = "" if b["peak_gb"] is None else f"{b['peak_gb']:.1f}"
            idle = b.get("ms_idle")
            eff_idle = (f"{cudnn_idle / (idle * case['ideal_ratio']):.3f}"
                        if cudnn_idle and idle and meth != "sdpa_cudnn_dup" else "")
            lines.append(f"| {meth} | {f['ms']:.2f} | {f['tflops']:.3g} | {b['ms']:.2f} | {b['tflops']:.3g} | {sp} | {eff} "
                         f"| {pk} | {'' if idle is None else f'{idle:.2f}'} | {eff_idle} |")
        lines.append("")
    if results.get("skipped"):
        lines += ["## Skipped", ""] + [f"- {k}: {v}" for k, v in results["skipped"].items()] + [""]
    if notes:
        lines += ["## Notes", ""] + [f"- {k}: {'; '.join(sorted(v))}" for k, v in notes.items()] + [""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    uni = [c for c in results["cases"] if c["groups"] == 1 and isinstance(c["P"], int) and isinstance(c["R"], int)]
    Rs = sorted({c["R"] for c in uni})
    if not Rs:
        return
    fig, axes = plt.subplots(1, len(Rs), figsize=(6 * len(Rs), 4.5), squeeze=False)
    for ax, R in zip(axes[0], Rs):
        cases = sorted((c for c in uni if c["R"] == R), key=lambda c: (c["P"], c["N"]))
        methods = list(dict.fromkeys(r["method"] for r in results["rows"]))
        for meth in methods:
            xs, ys = [], []
            for c in cases:
                rows = [r for r in results["rows"] if r["case"] == c["case"] and r["mode"] == "fwd+bwd"]
                base = next((r["ms"] for r in rows if r["method"] in ("sdpa_flash_dup", "sdpa_dup") and r["ms"]), None)
                me = next((r["ms"] for r in rows if r["method"] == meth and r["ms"]), None)
                if base and me:
                    xs.append(c["P"])
                    ys.append(base / me)
            if xs:
                ax.plot(xs, ys, marker="o", label=meth)
        ax.plot([c["P"] for c in cases], [c["ideal_ratio"] for c in cases], "k--", label="ideal (pairs ratio)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("prompt length P")
        ax.set_ylabel("speedup over SDPA-flash, duplicated batch (fwd+bwd)")
        ax.set_title(f"R = {R} (N: " + ", ".join(f"P{c['P']}:N{c['N']}" for c in cases) + ")", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    m = results["meta"]
    fig.suptitle(f"{m['device']}, torch {m['torch']}, Hq={m['hq']} Hkv={m['hkv']} D={m['d']} {m['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--stem", default=None, help="output file stem (default attention_<device>[_quick])")
    ap.add_argument("--budget-ms", type=float, default=400.0, help="time budget per measurement after warm-up")
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--max-reps", type=int, default=30)
    ap.add_argument("--skip-mask", action="store_true", help="skip the block-mask measurements")
    ap.add_argument("--plot-only", type=Path, default=None, help="redraw the PNG and Markdown from a results JSON")
    args = ap.parse_args(argv)

    if args.plot_only:
        results = json.loads(args.plot_only.read_text())
        stem = args.plot_only.with_suffix("")
        stem.with_suffix(".md").write_text(markdown(results))
        plot(results, stem.with_suffix(".png"))
        return 0

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    if device.type == "cpu":
        cfg = Cfg(4, 2, 16, torch.float32, device)
        shapes = args.shapes or CPU_SHAPES + ["groups", "tree"]
        args.budget_ms, args.max_reps, args.skip_mask = min(args.budget_ms, 50.0), min(args.max_reps, 5), True
    else:
        cfg = Cfg(32, 8, 128, torch.bfloat16, device)
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

    meta = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        torch=torch.__version__,
        triton=_triton_version(),
        cuda=torch.version.cuda,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        hq=cfg.hq, hkv=cfg.hkv, d=cfg.d, dtype=str(cfg.dtype).replace("torch.", ""),
        cuda_timing=device.type == "cuda", quick=args.quick, budget_ms=args.budget_ms, min_reps=args.min_reps, max_reps=args.max_reps,
    )
    log(f"{meta['device']} torch {meta['torch']} triton {meta['triton']}; methods {list(methods)}; skipped {skipped}")
    results = dict(meta=meta, cases=[c.summary() for c in cases], rows=[], skipped=skipped)
    stem = args.stem or ("attention_" + ("cpu" if device.type == "cpu" else _slug(meta["device"])) + ("_quick" if args.quick else ""))

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
        write_report(results, args.out, stem)

    t_start = time.time()
    for case in cases:
        log(f"case {case.name}: T={case.num_tokens} rows={len(case.rows)} ideal ratio {case.ideal_ratio:.2f}x")
        for name, setup in methods.items():
            results["rows"] += run_method(name, setup, case, cfg, args)
        write_report(results, args.out, stem)  # after every case: a killed run keeps what it measured
    log(f"done in {time.time() - t_start:.0f}s; wrote {args.out}/{stem}.{{json,md,png}}")
    print(markdown(results))
    return 0


def _triton_version() -> Optional[str]:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
