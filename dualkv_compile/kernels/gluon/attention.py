"""The warp-specialised Hopper kernels of shared-prompt attention (Gluon), behind the op's backend protocol.

    supports(q, v=None, *, window=0, chunk=0, sinks=False, softcap=0.0) -> None, or why the kernels cannot run q
    operands_reason(**operands) -> None, or which operand has no 2-D tensor-descriptor view (asked per call)
    forward(q, k, v, segs, scale, softcap=0.0) -> (out, lse)
    backward(dout, q, k, v, out, lse, segs, scale, deterministic, softcap=0.0) -> (dq, dk, dv)

The forward is ``fwd.py``. The backward is the shared preprocess kernel (``common/row_statistics.py``: Delta =
rowsum(dO * O), and a packed copy of the row statistics), then ``dkdv.py`` (KV-major dK/dV) and ``dq.py``
(Q-major dQ), both without atomics; with long prompts (``DkdvConfig.dq_mode`` "auto", head dim 128, not
deterministic) the dK/dV kernel adds dQ itself and no Q-major pass runs. Both read the same ``out`` and ``lse``
(natural log, float32). Every operand loads through a 2-D tensor descriptor (``common/tma.py``).

Assumes ``Segments`` as the Triton kernels do (``common/schedule.py``): the schedules and ancestor walks are
theirs, cached across a step's layers, so the layout reaches the kernels as data and never recompiles them.
Guarantees: ``supports`` is None only on a Hopper (sm_90) GPU with a Triton whose Gluon has Hopper's wgmma, TMA
and warp specialisation, for bfloat16 or float16 q, k, v with one head dim of 64 or 128, no window and no
softcap; anything else gets the reason (the device first, then Triton, the dtype, the head dims, the features),
and the op's "auto" moves on. ``forward`` and ``backward`` raise ``ValueError`` on an input ``supports`` or
``operands_reason`` refuses: they run these kernels or none (``ops.attention`` decides what runs instead).
Measured speeds and the tile choices below: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ...layout.segments import Segments
from ..common.launch import LAUNCH_OPTIONS, check_launch
from ..common.schedule import ancestor_walk, tile_schedule
from ..common.tma import tma_geometry
from ..device import capability, sm_count

__all__ = ["supports", "operands_reason", "forward", "backward", "KernelTiles", "FwdConfig", "FWD_CONFIGS", "DqConfig", "DQ_CONFIGS",
           "DkdvConfig", "DKDV_CONFIGS", "DQ_MODES", "resolve_dq_mode"]

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
DQ_MODES = ("atomic", "auto", "recompute")


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """What every Gluon kernel's launch takes: ``block_m`` query rows and ``block_n`` keys per tile, rings
    ``stages`` deep, and the partitions' register budgets (``setmaxnreg``: two consumer warpgroups at
    ``consumer_regs``, the loader at ``loader_regs``; it needs few). Each kernel's config says which of
    the two a program owns and which it streams."""

    block_m: int = 128
    block_n: int = 128
    stages: int = 2
    consumer_regs: int = 240
    loader_regs: int = 24


@dataclasses.dataclass(frozen=True)
class FwdConfig(KernelTiles):
    """Tiles of the forward: ``block_m`` query rows per program (two warpgroups of half each),
    ``block_n`` keys per block, a ring of ``stages`` K and V blocks; and whether the two consumer
    warpgroups issue their products in turns (FA3's ping-pong, ordered by mbarriers; off by default, as it
    measured slower: docs/benchmarks.md, "Behind the code")."""

    pingpong: bool = False


# Measured (docs/benchmarks.md, "Behind the code"): two stages beat three, and
# 64-key blocks, at both head dims. Shared memory at D=128: Q 32 KB + stages x (K 32 KB + V 32 KB).
FWD_CONFIGS: dict[int, FwdConfig] = {
    64: FwdConfig(128, 128, 2),
    128: FwdConfig(128, 128, 2),
}


@functools.lru_cache(maxsize=None)
def _gluon_missing() -> Optional[str]:
    """Why the installed Triton cannot build these kernels (None: it can); asked once, on every call of ``supports``."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError as e:
        return f"this Triton has no Gluon for Hopper ({e})"
    for name, mod in (("warp_specialize", gl), ("warpgroup_mma", hopper), ("warpgroup_mma_wait", hopper)):
        if not hasattr(mod, name):
            return f"this Triton's Gluon lacks {name}"
    return None


def _supports_input(q: torch.Tensor, v: Optional[torch.Tensor] = None) -> Optional[str]:
    """None if the Gluon kernels can run q (and v); else the reason."""
    if q.device.type != "cuda":
        return f"the Gluon kernels need a Hopper GPU (sm_90, compute capability 9.0); this input is on {q.device.type}"
    cc = capability(q.device)
    if cc != (9, 0):
        return f"the Gluon kernels need compute capability 9.0 (wgmma); this GPU has {cc[0]}.{cc[1]}"
    missing = _gluon_missing()
    if missing is not None:
        return missing
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} is not supported (bfloat16, float16)"
    D = q.shape[-1]
    if v is not None and v.shape[-1] != D:
        return f"q/k head dim {D} and v head dim {v.shape[-1]} differ (MLA runs on the Triton kernels)"
    if D not in HEAD_DIMS:
        return f"head dim {D} is not supported ({', '.join(map(str, HEAD_DIMS))}; others run on the Triton kernels)"
    return None

def supports(q: torch.Tensor, v: Optional[torch.Tensor] = None, *, window: int = 0, chunk: int = 0,
             sinks: bool = False, softcap: float = 0.0) -> Optional[str]:
    """None if the Gluon kernels can run q (and v) with these windows, sinks and softcap; else the reason."""
    why = _supports_input(q, v)
    if why is not None:
        return why
    if window or chunk:
        return f"the Gluon kernels do not implement sliding or chunked windows yet (window={window}, chunk={chunk})"
    return _softcap_reason(softcap)


def _softcap_reason(softcap: float) -> Optional[str]:
    if softcap:
        return f"the Gluon kernels do not implement a logit softcap (softcap={softcap}; the Triton kernels do)"
    return None


def operands_reason(**operands: torch.Tensor) -> Optional[str]:
    """None if every operand (by name: q, k, v; the backward's q, dout, k, v) has the 2-D tensor-descriptor view
    the kernels load through (``common.tma.tma_geometry``), else which has none. It depends on one call's strides,
    alignment and length (a one-token stream has none), which ``supports`` never sees: ``ops.attention`` asks."""
    for name, t in operands.items():
        if tma_geometry(t) is None:
            return (f"{name} (shape {list(t.shape)}, strides {list(t.stride())}) has no 2-D tensor-descriptor view "
                    "(16-byte aligned rows, head- or token-major, at least two tokens)")
    return None


def _refuse(why: Optional[str]) -> None:
    if why is not None:
        raise ValueError(f"gluon attention cannot run this input: {why}")


def _gl_dtype(dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple, dtype: torch.dtype):
    """The NVMMA shared layout of a ``block`` tile of ``dtype``: built once per tile shape (it is a constant)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), _gl_dtype(dtype))


def _descriptor(t: torch.Tensor, rows: int):
    """A Gluon tensor descriptor over ``t``'s 2-D view with ``rows`` x D blocks, and (row_h, col_h); None without a view."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    geometry = tma_geometry(t)
    if geometry is None:
        return None
    shape, strides, row_h, col_h = geometry
    block = [rows, t.shape[-1]]
    return TensorDescriptor(t, shape, strides, block, _shared_layout(tuple(block), t.dtype)), row_h, col_h


def _backward_descriptors(tiles: KernelTiles, q, dout, k, v) -> list:
    """``_descriptor`` of q and dO (``tiles.block_m`` rows) and of k and v (``tiles.block_n`` rows)."""
    return [_descriptor(t, r) for t, r in ((q, tiles.block_m), (dout, tiles.block_m), (k, tiles.block_n),
                                           (v, tiles.block_n))]


def forward(q, k, v, segs: Segments, scale: float, softcap: float = 0.0, *, config: Optional[FwdConfig] = None):
    """``(out [1, Hq, T, D] in q's dtype, lse [1, Hq, T] float32)``."""
    _refuse(supports(q, v) or _softcap_reason(softcap) or operands_reason(q=q, k=k, v=v))
    _, Hq, T, D = q.shape
    Hkv = k.shape[1]
    cfg = config or FWD_CONFIGS[D]
    descs = [_descriptor(t, r) for t, r in ((q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n))]
    check_launch(q, k, segs, "gluon")
    out = torch.empty((1, Hq, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((1, Hq, T), dtype=torch.float32, device=q.device)
    if T == 0 or Hq == 0:
        return out, lse
    from .fwd import shared_prompt_fwd_kernel

    tiles = tile_schedule(segs, T, cfg.block_m, "q")
    (qd, q_row, q_col), (kd, k_row, k_col), (vd, v_row, v_col) = descs
    shared_prompt_fwd_kernel[(Hq, tiles.shape[1])](
        qd, kd, vd, out, lse, tiles, tiles.shape[1], q_row, q_col, k_row, k_col, v_row, v_col,
        segs.seg_start, segs.seg_len, ancestor_walk(segs, cfg.block_n),
        out.stride(1), out.stride(2), out.stride(3), lse.stride(1),
        Hq // Hkv, scale * LOG2E,
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        LOADER_REGS=cfg.loader_regs, CONSUMER_REGS=cfg.consumer_regs, PINGPONG=cfg.pingpong, num_warps=4,
        **LAUNCH_OPTIONS,
    )
    return out, lse


@dataclasses.dataclass(frozen=True)
class DqConfig(KernelTiles):
    """Tiles of the dQ kernel (``dq.py``): as ``FwdConfig``; 64-key blocks keep S, dP, dQ and dS of a
    64-row warpgroup in registers."""

    block_n: int = 64
    stages: int = 4


# Measured at D=128 (docs/benchmarks.md, "Behind the code"): 4 stages of 64 keys beat 2 and 3, and 32-key blocks.
DQ_CONFIGS: dict[int, DqConfig] = {64: DqConfig(), 128: DqConfig()}


@dataclasses.dataclass(frozen=True)
class DkdvConfig(KernelTiles):
    """Tiles of the dK/dV kernel (``dkdv.py``): ``block_n`` keys per program (two warpgroups of half
    each, their dK and dV in registers), ``block_m`` query rows per step through ``stages``-deep rings
    of q, dO and the row statistics. ``dq_mode`` applies to the default (non-deterministic) backward at
    head dim 128 (other head dims, and the deterministic mode, always recompute):

        "recompute"  the dQ kernel recomputes S and dP: 7 products per block pair over two kernels, no
                     atomics anywhere;
        "atomic"     the dK/dV kernel also forms dQ = dS K (the warpgroups splitting the head dim) and adds
                     it into a float32 buffer by the copy engine's bulk reductions, FA3's way: 5 products,
                     but float32 adds in L2 in no fixed order;
        "auto"       "atomic" when the longest ancestor chain's key tiles, over all kv heads, fill at least
                     ``atomic_min_waves`` waves of the GPU's SMs, else "recompute" (``resolve_dq_mode``).

    Why "auto": "atomic" measured faster than "recompute" where the long prompts' key tiles fill several
    waves of SMs and slower where they fill about one (docs/benchmarks.md, "Behind the code"). Its dQ costs
    least per block pair in long, many-program key loops; with few long-prompt tiles their programs are the
    critical path, and the dQ work added to each makes it longer."""

    block_m: int = 64
    dq_mode: str = "auto"
    atomic_min_waves: float = 3.0

    def __post_init__(self):
        if self.dq_mode not in DQ_MODES:
            raise ValueError(f"DkdvConfig.dq_mode: expected one of {DQ_MODES}, got {self.dq_mode!r}")
        if not isinstance(self.atomic_min_waves, (int, float)) or not self.atomic_min_waves >= 0:
            raise ValueError(f"DkdvConfig.atomic_min_waves: expected a number >= 0, got {self.atomic_min_waves!r}")


def resolve_dq_mode(config: DkdvConfig, deterministic: bool, head_dim: int, max_prefix_len: int, kv_heads: int,
                    num_sms: int) -> str:
    """The dQ mode a backward runs: "recompute" or "atomic" (``DkdvConfig`` says what each is). "auto" counts
    the key tiles of the longest ancestor chain (``max_prefix_len``, a host int of ``Segments``: no sync)
    times ``kv_heads``, in waves of ``num_sms`` programs."""
    if deterministic or head_dim != 128:
        return "recompute"
    if config.dq_mode != "auto":
        return config.dq_mode
    waves = -(-max_prefix_len // config.block_n) * kv_heads / max(num_sms, 1)
    return "atomic" if waves >= config.atomic_min_waves else "recompute"


# D=64: 128-row steps, measured faster than 64-row ones (docs/benchmarks.md, "Behind the code"), though
# sm90_resources.py counts spills in their loops (the stores go to L1).
DKDV_CONFIGS: dict[int, DkdvConfig] = {64: DkdvConfig(block_m=128), 128: DkdvConfig()}


def _float_descriptor(t: torch.Tensor, block: list):
    """A descriptor over a contiguous 2-D float32 tensor: the packed row statistics, the dQ buffer."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _shared_layout(tuple(block), torch.float32))


def backward(dout, q, k, v, out, lse, segs: Segments, scale: float, deterministic: bool = False, softcap: float = 0.0,
             *, config: Optional[DqConfig] = None, dkdv_config: Optional[DkdvConfig] = None):
    """``(dq, dk, dv)``: dK and dV by the Gluon KV-major kernel (``dkdv.py``), dQ by the Gluon Q-major one
    (``dq.py``); neither has atomics. When ``resolve_dq_mode`` gives "atomic" (long prompts under the default
    "auto"; head dim 128, never ``deterministic``) the dK/dV kernel adds dQ into a float32 buffer instead and
    no dQ kernel runs; the order of those float32 adds, so dQ's last bits, varies from run to run. dK and dV
    are the same bits either way, and ``deterministic=True`` always gives the same bits. A softcap, or an
    operand without a 2-D descriptor view, is refused (``ValueError``), as in the forward."""
    _refuse(supports(q, v) or _softcap_reason(softcap) or operands_reason(q=q, dout=dout, k=k, v=v))
    _, Hq, T, D = q.shape
    Hkv = k.shape[1]
    cfg = config or DQ_CONFIGS[D]
    kcfg = dkdv_config or DKDV_CONFIGS[D]
    # The dK/dV kernel's descriptors; the dQ kernel's (same tensors, its own blocks) only if it runs.
    descs = _backward_descriptors(kcfg, q, dout, k, v)
    check_launch(q, k, segs, "gluon")
    # The atomic dQ splits the head dim between the two warpgroups at a 128-byte swizzle boundary: D=128 only.
    # (No SM count off a GPU: sm90_resources.py compiles these kernels from CPU tensors, in explicit modes.)
    sms = sm_count(q.device) if q.is_cuda else 1
    atomic_dq = resolve_dq_mode(kcfg, deterministic, D, segs.max_prefix_len, Hkv, sms) == "atomic"
    dq = torch.zeros((1, Hq, T, D), dtype=torch.float32, device=q.device) if atomic_dq else \
        torch.empty((1, Hq, T, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((1, Hkv, T, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((1, Hkv, T, D), dtype=v.dtype, device=q.device)
    if T == 0 or Hq == 0:
        return dq.to(q.dtype), dk, dv
    from ..common.row_statistics import row_statistics
    from .dkdv import shared_prompt_dkdv_kernel
    from .dq import shared_prompt_dq_kernel

    lse = lse.float().contiguous()
    delta, stats = row_statistics(out, dout, lse, pack=True)
    (qd, q_row, q_col), (dod, do_row, do_col), (kd, k_row, k_col), (vd, v_row, v_col) = descs
    tiles = tile_schedule(segs, T, kcfg.block_n, "kv")
    shared_prompt_dkdv_kernel[(Hkv, tiles.shape[1])](
        qd, dod, kd, vd, _float_descriptor(stats, [kcfg.block_m, 4]), dk, dv,
        _float_descriptor(dq.view(Hq * T, D), [kcfg.block_m, 32]) if atomic_dq else None, tiles, tiles.shape[1],
        q_row, q_col, do_row, do_col, k_row, k_col, v_row, v_col, T,
        segs.seg_start, segs.seg_len, segs.subtree_end,
        dk.stride(1), dk.stride(2), dk.stride(3), dv.stride(1), dv.stride(2), dv.stride(3),
        Hq // Hkv, scale * LOG2E, scale,
        HEAD_DIM=D, BLOCK_M=kcfg.block_m, BLOCK_N=kcfg.block_n, STAGES=kcfg.stages,
        LOADER_REGS=kcfg.loader_regs, CONSUMER_REGS=kcfg.consumer_regs, ATOMIC_DQ=atomic_dq,
        DS_LAYOUT=_shared_layout((kcfg.block_n, kcfg.block_m), q.dtype),
        num_warps=4, **LAUNCH_OPTIONS,
    )
    if atomic_dq:
        return dq.to(q.dtype), dk, dv

    tiles = tile_schedule(segs, T, cfg.block_m, "q")
    (qd, q_row, q_col), (dod, do_row, do_col), (kd, k_row, k_col), (vd, v_row, v_col) = _backward_descriptors(
        cfg, q, dout, k, v)
    shared_prompt_dq_kernel[(Hq, tiles.shape[1])](
        qd, dod, kd, vd, dq, lse, delta, tiles, tiles.shape[1],
        q_row, q_col, do_row, do_col, k_row, k_col, v_row, v_col,
        segs.seg_start, segs.seg_len, ancestor_walk(segs, cfg.block_n),
        dq.stride(1), dq.stride(2), dq.stride(3), lse.stride(1),
        Hq // Hkv, scale * LOG2E, scale,
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        LOADER_REGS=cfg.loader_regs, CONSUMER_REGS=cfg.consumer_regs, num_warps=4, **LAUNCH_OPTIONS,
    )
    return dq, dk, dv
