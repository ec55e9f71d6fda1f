"""The hand-written Triton kernels of shared-prompt attention, behind the op's backend protocol.

    supports(q, v=None, *, window=0, chunk=0, sinks=False, softcap=0.0) -> None, or why the kernels cannot run q
    forward(q, k, v, segs, scale, softcap=0.0, window=0, chunk=0) -> (out, lse)
    backward(dout, q, k, v, out, lse, segs, scale, deterministic, softcap=0.0, window=0, chunk=0) -> (dq, dk, dv)

The launcher, with the tuning tables re-exported from ``configs.py``. The kernels (``fwd.py``, ``bwd.py``,
``bwd_dq.py``; shared loads in ``tiles.py``; the preprocess in ``common/``) take the layout only as int32 tensors:
``common/schedule.py`` turns ``Segments`` into tile schedules and ancestor walks (no host sync, cached across a
step's layers), and the grids come from the host ints T, the number of segments and the head counts, so a new
layout never recompiles them.

Assumes ``Segments`` in pre-order (a query tile walks its ancestor chain; a key tile's readers are one run up to
its subtree's end); offsets inside one head fit in int32 (``T * token_stride < 2**31``, checked). Runs on CUDA
(compute capability 8.0+) and, for tests, on CPU under ``TRITON_INTERPRET=1``, set before the kernels' first import.
Guarantees: ``forward`` and ``backward`` write every valid row of their outputs and raise ``ValueError`` on an
input ``supports`` refuses; outputs come back in the inputs' dtypes (lse float32, float64 for float64 inputs),
accumulated in float32 (float64 for float64 inputs). ``deterministic=True`` runs the KV-major dK/dV kernel with
all query heads of a kv head in one program plus the Q-major dQ kernel: no atomics, bitwise reproducible;
otherwise the tuning table's choice, which may add atomics (``head_split`` > 1, ``dq_mode="atomic"``). A softcap
is the compile-time ``SOFTCAP`` (0.0: the kernels without it); MLA head dims run zero-padded (``head_dims``);
windows (token depth, docs/design.md, semantics 15) are runtime ints whose plans (``windows.py``) skip the blocks
no row sees; sinks are applied around the kernels (``ops/backend_calls.py``). Loads, precision and variants:
docs/design.md, "Triton kernels".
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from ...layout.segments import Segments, check_window
from ..device import capability
from ..head_dims import common_head_dim, pad_head_dim
from .configs import (  # the tuning tables, re-exported here where they lived first
    _FP32_CUDA_CONFIG, _GENERIC_CONFIGS, _INTERPRET_CONFIG, DQ_MODES, HOPPER_CONFIGS, Config, KernelConfig, config_for,
)
from ..common.launch import LAUNCH_OPTIONS, block_d, check_launch
from ..common.schedule import ancestor_walk, tile_schedule
from .tma import descriptors, interpreting, row_stats_descriptor
from .windows import NONE, subtree_next, window_args, window_schedule

log = logging.getLogger("dualkv_compile")

__all__ = ["supports", "forward", "backward", "backward_dkdv", "KernelConfig", "Config", "config_for", "HOPPER_CONFIGS"]

LOG2E = 1.4426950408889634

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The accumulators' dtype (lse, Delta, atomic buffers): float64 for float64, else float32 (as in the kernels)."""
    return torch.promote_types(dtype, torch.float32)


def _supports_input(q: torch.Tensor, v: Optional[torch.Tensor] = None) -> Optional[str]:
    """None if the kernels can run q (and v); else the reason: the device first, then the dtype, then the head dim."""
    needs = "it needs a CUDA tensor or the Triton interpreter (TRITON_INTERPRET=1 before importing dualkv_compile)"
    if q.device.type == "cuda":
        if capability(q.device) < (8, 0):
            return "the Triton kernels need a CUDA GPU of compute capability 8.0 or newer"
    elif q.device.type == "cpu":
        if not interpreting():
            return f"{needs}; this input is on cpu"
        try:
            from . import fwd
        except ImportError as e:
            return f"Triton is unavailable: {e}"

        if type(fwd.shared_prompt_fwd_kernel).__name__ != "InterpretedFunction":
            return "TRITON_INTERPRET=1 was set after the kernels were compiled for GPU; set it before importing dualkv_compile"
    else:
        return f"{needs}; this input is on {q.device.type}"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} is not supported (bfloat16, float16, float32; float64 under the interpreter)"
    if q.dtype == torch.float64 and q.device.type == "cuda":
        # Untested on GPUs, and Python float arguments (the scales) reach compiled kernels as float32.
        return "dtype torch.float64 runs only under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors)"
    D = q.shape[-1] if v is None else common_head_dim(q, v)
    if not 16 <= D <= 256:
        mla = "" if v is None or v.shape[-1] == q.shape[-1] else f" (q/k {q.shape[-1]} and v {v.shape[-1]} run at the larger)"
        return f"head dim {D} is not supported (16 to 256){mla}"
    return None


def supports(q: torch.Tensor, v: Optional[torch.Tensor] = None, *, window: int = 0, chunk: int = 0,
             sinks: bool = False, softcap: float = 0.0) -> Optional[str]:
    """None if the Triton kernels can run q (and v) with these windows, sinks and softcap; else the reason."""
    # Windows of any size run (windows.py); sinks apply around the kernels (ops/backend_calls.py), whose
    # backward reads the saved out and lse as sinks need.
    return _supports_input(q, v)


# --------------------------------------------------------------------------- launches


def _check(q: torch.Tensor, k: torch.Tensor, segs: Segments) -> None:
    why = supports(q)  # q and k here are already padded to the common head dim
    if why is not None:
        raise ValueError(f"triton attention cannot run this input: {why}")
    check_launch(q, k, segs, "triton")


def _dot_flags(q: torch.Tensor) -> dict:
    # The CPU interpreter gets bf16 dots wrong; the kernels then widen bf16 tiles to fp32 at load.
    upcast = q.device.type == "cpu" and q.dtype == torch.bfloat16
    if q.dtype in (torch.float32, torch.float64) or upcast:
        # fp32 inputs get (near-)fp32 products, not tf32: exact ones in the interpreter,
        # 3-pass tf32 on GPU (IEEE fp32 dots compile for minutes and run on FMA units).
        # fp64 (interpreter only) gets exact fp64 products.
        return dict(DOT_PREC="tf32x3" if q.device.type == "cuda" else "ieee", UPCAST=upcast)
    return dict(DOT_PREC="tf32", UPCAST=False)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(1), t.stride(2), t.stride(3)


def _query_tiles(segs: Segments, T: int, c: KernelConfig, window: int, chunk: int) -> tuple[torch.Tensor, tuple, dict]:
    """The forward's and dQ kernel's schedule, their window arguments (PREFIX_LEN, window, chunk) and flag.

    Under windows the schedule carries the ancestor blocks each tile reaches (``windows.window_schedule``)
    and the sizes go in as runtime ints; without, the kernels compile without the windowed walk, as before.
    """
    if not (window or chunk):
        return tile_schedule(segs, T, c.block_m, "q"), (segs.prefix_len, 0, 0), dict(WINDOW=False)
    tiles = window_schedule(segs, T, c.block_m, c.block_n, window, chunk)
    return tiles, (segs.prefix_len, *window_args(window, chunk)), dict(WINDOW=True)


def _check_window(window: int, chunk: int, T: int) -> None:
    check_window(window, chunk)
    if (window or chunk) and T >= NONE:
        raise ValueError(f"triton attention: windows need T < {NONE}, got T={T}")


def forward(q, k, v, segs: Segments, scale: float, softcap: float = 0.0, window: int = 0, chunk: int = 0, *,
            config: Optional[Config] = None):
    """``(out [1, Hq, T, Dv] in q's dtype, lse [1, Hq, T] float32, float64 for float64 inputs)``; ``window`` and
    ``chunk`` (0: none) on token depth (``layout.segments``)."""
    Dv, D = v.shape[-1], common_head_dim(q, v)
    if Dv != q.shape[-1]:  # MLA: one head dim for the kernels, zero-padded (exact)
        out, lse = forward(*(pad_head_dim(t, D) for t in (q, k, v)), segs, scale, softcap, window, chunk, config=config)
        return out[..., :Dv], lse
    from .fwd import shared_prompt_fwd_kernel

    _check(q, k, segs)
    _check_window(window, chunk, q.shape[2])
    _, Hq, T, D = q.shape
    Hkv = k.shape[1]
    cfg = (config or config_for(q)).fwd
    out = torch.empty((1, Hq, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((1, Hq, T), dtype=_acc(q.dtype), device=q.device)
    if T == 0 or Hq == 0:
        return out, lse
    tiles, win_args, win_flag = _query_tiles(segs, T, cfg, window, chunk)
    descs, tma = descriptors(cfg, cfg.block_n, k, v)
    shared_prompt_fwd_kernel[(Hq, tiles.shape[1])](
        q, k, v, out, lse, tiles, tiles.shape[1], *descs,
        segs.seg_start, segs.seg_len, ancestor_walk(segs, cfg.block_n),
        *_strides(q), *_strides(k), *_strides(v), *_strides(out), lse.stride(1),
        Hq // Hkv, scale * LOG2E, *win_args,
        HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        **_dot_flags(q), TMA=tma, SOFTCAP=float(softcap), **win_flag, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **LAUNCH_OPTIONS,
    )
    return out, lse


def backward(dout, q, k, v, out, lse, segs: Segments, scale: float, deterministic: bool = False, softcap: float = 0.0,
             window: int = 0, chunk: int = 0, *, config: Optional[Config] = None):
    """``(dq, dk, dv)``; dk and dv per kv head (summed over the query heads that share it). P comes from the
    saved ``lse`` and Delta from the saved ``out`` (so sinks compose: ``kernels.sinks``)."""
    Dqk, Dv, D = q.shape[-1], v.shape[-1], common_head_dim(q, v)
    if Dv != Dqk:  # MLA: zero-padded, as in the forward
        padded = (pad_head_dim(t, D) for t in (dout, q, k, v, out))
        dq, dk, dv = backward(*padded, lse, segs, scale, deterministic, softcap, window, chunk, config=config)
        return dq[..., :Dqk], dk[..., :Dqk], dv[..., :Dv]
    from .bwd_dq import bwd_dq_kernel

    full = config or config_for(q)
    atomic_dq = not deterministic and full.dq_mode == "atomic"
    dq, dk, dv, delta, lse = backward_dkdv(dout, q, k, v, out, lse, segs, scale, deterministic, softcap, window, chunk,
                                           config=full, atomic_dq=atomic_dq)
    _, Hq, T, D = q.shape
    if not atomic_dq:  # the Q-major dQ pass
        dq = torch.empty((1, Hq, T, D), dtype=q.dtype, device=q.device)
    if not atomic_dq and T and Hq:
        c = full.dq
        tiles, win_args, win_flag = _query_tiles(segs, T, c, window, chunk)
        descs, tma = descriptors(c, c.block_n, k, v)
        bwd_dq_kernel[(Hq, tiles.shape[1])](
            q, k, v, dout, lse, delta, dq, tiles, tiles.shape[1], *descs,
            segs.seg_start, segs.seg_len, ancestor_walk(segs, c.block_n),
            *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq),
            lse.stride(1), Hq // k.shape[1], scale * LOG2E, scale, *win_args,
            HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            **_dot_flags(q), TMA=tma, SOFTCAP=float(softcap), **win_flag, num_warps=c.num_warps,
            num_stages=c.num_stages, **LAUNCH_OPTIONS,
        )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def backward_dkdv(dout, q, k, v, out, lse, segs: Segments, scale: float, deterministic: bool = False,
                  softcap: float = 0.0, window: int = 0, chunk: int = 0, *, config: Optional[Config] = None,
                  atomic_dq: bool = False):
    """The backward without its Q-major dQ pass: ``(dq, dk, dv, delta, lse)``.

    dq is None unless ``atomic_dq`` (then the dK/dV kernel added dS K into it, float32); ``delta``
    (rowsum(dO * O)) and ``lse`` (float32, contiguous) are what a dQ pass reads. q, k, v share one
    head dim (MLA is padded by ``backward``). dk and dv come back in their float32 buffers when the
    config splits heads, else in k's dtype.
    """
    from ..common.row_statistics import row_statistics
    from .bwd import bwd_dkdv_kernel

    _check(q, k, segs)
    _, Hq, T, D = q.shape
    _check_window(window, chunk, T)
    Hkv = k.shape[1]
    G = Hq // Hkv
    full = config or config_for(q)
    head_split = 1 if deterministic else math.gcd(full.head_split, G)
    dev, BD, acc = q.device, block_d(D), _acc(q.dtype)
    lse = lse.to(acc).contiguous()
    flags = _dot_flags(q)

    dq = torch.zeros((1, Hq, T, D), dtype=acc, device=dev) if atomic_dq else None
    acc_dtype = acc if head_split > 1 else k.dtype
    dk = (torch.zeros if head_split > 1 else torch.empty)((1, Hkv, T, D), dtype=acc_dtype, device=dev)
    dv = (torch.zeros if head_split > 1 else torch.empty)((1, Hkv, T, D), dtype=acc_dtype, device=dev)
    if T == 0 or Hq == 0:
        return dq, dk, dv, torch.empty((1, Hq, T), dtype=acc, device=dev), lse

    c = full.dkdv
    descs, tma = descriptors(c, c.block_m, q, dout)
    stats_tma = tma and c.stats_tma
    delta, stats = row_statistics(out, dout, lse, pack=stats_tma)

    tiles = tile_schedule(segs, T, c.block_n, "kv", window, chunk)
    # Under windows the kernel walks a key tile's readers segment by segment (subtree_next skips the
    # subtrees the window does not reach); without, the arguments stand in unused.
    windowed = bool(window or chunk)
    win_args = (segs.prefix_len, subtree_next(segs), *window_args(window, chunk)) if windowed else (
        segs.prefix_len, segs.subtree_end, 0, 0)
    bwd_dkdv_kernel[(Hkv * head_split, tiles.shape[1])](
        # Without atomic dQ the kernel's dQ pointer is never written: q stands in (same dtype, as before).
        q, k, v, dout, lse, delta, dk, dv, dq if atomic_dq else q, tiles, tiles.shape[1], *descs,
        *((row_stats_descriptor(stats, c.block_m), T) if stats_tma else (None, 0)),
        segs.seg_start, segs.seg_len, segs.subtree_end,
        *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dk), *_strides(dv),
        *_strides(dq if atomic_dq else q),
        lse.stride(1), G, scale * LOG2E, scale, *win_args,
        HEAD_DIM=D, BLOCK_D=BD, BLOCK_M=c.block_m, BLOCK_N=c.block_n, HEAD_SPLIT=head_split,
        ATOMIC_DQ=atomic_dq, **flags, TMA=tma, STATS_TMA=stats_tma, SOFTCAP=float(softcap), WINDOW=windowed,
        num_warps=c.num_warps, num_stages=c.num_stages, **LAUNCH_OPTIONS,
    )
    return dq, dk, dv, delta, lse
